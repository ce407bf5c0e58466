// y = x @ W^T on AMX-BF16 tiles: bfloat16 weights, the rows of x rounded to
// bfloat16, float32 sums. Where the CPU has AMX-BF16, a prompt's projections
// ran 3.4-3.8x faster this way than w4a8's integer dots on AMX-INT8, which
// must fold every 16 inputs' dots out of the tiles (docs/performance.md, "AMX
// on this Xeon"): here a whole row's dot stays in its C tile.
//
// The result of a row does not depend on the batch: each output is one C tile
// element that tdpbf16ps accumulates over the 32-input blocks of K in order,
// from zero, whatever the number of rows, the rows beside it (a short tail is
// zero-padded to 16 rows) or the thread. tdpbf16ps's own rounding inside a
// block is the hardware's (it is not the SDM pseudocode's per-product rounding,
// so it cannot be emulated exactly): its results are this CPU kind's own, and
// the tests of this kernel run where AMX-BF16 is.
//
// Packed layout (models/quant.py pack_amx_bf16): W [N, K] as
// [ceil(N/16)][ceil(K/32)][16 input pairs][16 outputs][2], zero-padded: one
// 1 KB B operand per 16 outputs and 32 inputs.
//
// amx_w4a16_linear runs the same products on 4-bit weights (pack_w4a16), each
// 16 x 32 block made into that B operand in the kernel (w4_blocks_to_bf16): a
// decode step reads a quarter of the bytes, and the same bfloat16 operands give
// the same sums as amx_bf16_linear's, bit for bit. Making the operands costs
// about 9 vector instructions per 32 weights, which is what bounds a decode of a
// few rows (a single stream's step about 1.5x w4a8's, against 2x with bfloat16
// weights); from 17 rows a pair of tiles is made once for all row blocks.
// amx_w8a16_linear does the same for 8-bit weights (pack_w8a16: the LM head of the
// AMX-BF16 paths, Q8_0's codes).
//
// amx_quant_linear runs a GGUF file's codes (models/gguf_linear.py), most of them in a
// folded format: a code u of b <= 7 bits is the exact bfloat16 1 + u/2^b, each 32-input
// block's (or 16-input half's) product sums in a C tile of its own, and its scales are
// applied after: y += D * C + M * sum(x) (fold_rows). The weights keep every bit of their
// scales (only x is rounded to bfloat16), and making an operand is 2-3 instructions per 32
// weights, so a decode step streams the codes near the memory's speed (a Q4_K gate/up of
// 1536 x 17920 at one row: 1.04 ms, 19.9 GB/s; 2.03 ms with scaled 8-bit operands). Folding
// costs prompts: every block's C tile is stored and folded, about 2x a 256-row prompt's
// time against operands with the scales in them. A row's result still does not depend on
// the batch: each output folds its blocks in order, with the same two roundings.
// NOTE (measured on that projection at one row, Q4_K's own scales, 16.3 MB): 1.14 ms; without
// the folds' tile stores 0.76 ms (21.6 GB/s, the memory's speed), and the stores cost the
// same folded one block later, with operands made two blocks ahead or prefetched 4-16
// blocks ahead. What bounds one stream now is a tile store per block per 16 outputs.
#include "grouped_gemm_amx.h"
#include "kernels.h"
#include "parallel.h"

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kvserve {
namespace {

#if defined(__x86_64__)
bool cpu_has_amx_bf16() {
  const unsigned d = cpuid7_edx();
  return (d >> 22 & 1) && (d >> 24 & 1);  // AMX-BF16, AMX-TILE
}

// Tiles 0/1: A (16 rows x 32 bf16 of two row blocks), 2/3: B (two output tiles),
// 4-7: C (row block x output tile).
void configure_bf16_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  load_tile_config(cfg);
}

// For quant_item_small: tile 0 A (rows x 32 bfloat16), 1-2 B, 3-7 C (rows x 16).
// A product's time grows with its rows: at one row a 16-row tile did 16x the work.
void configure_small_tiles(int rows) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = (t == 1 || t == 2) ? 16 : rows, cfg.colsb[t] = 64;
  load_tile_config(cfg);
}

constexpr int64_t kRowsPerItem = 32;  // two 16-row A tiles
constexpr int64_t kTilesPerItem = 2;  // two 16-output B tiles
constexpr int64_t kPrefetch = 4;      // weight blocks fetched ahead

void store_c_tiles(float* y, int64_t m, int64_t n, int64_t r0, int64_t t0, float* buf);

// Rows [r0, r0 + 32) x tiles [t0, t0 + 2) of y, from xb (bfloat16 rows, kp
// inputs each, padded) and the packed weights.
//
// w0, w1: the pair's B operands ([kbs][512] bfloat16 each; w1 unread for a last lone
// tile). ahead, ahead_lines: the next pair's weights, fetched into L2 a few lines per
// block by this pair's later row blocks, so its first row block finds them there.
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw"))) void amx_bf16_item(
    float* y, int64_t m, int64_t n, const uint16_t* xb, int64_t kp, const uint16_t* w0, const uint16_t* w1,
    int64_t kbs, int64_t tiles, int64_t r0, int64_t t0, float* buf, bool first, const char* ahead,
    int64_t ahead_lines, int64_t row_items) {
  const bool two_rows = r0 + 16 < m, two_tiles = t0 + 1 < tiles;
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  const int64_t j = r0 / kRowsPerItem;
  const int64_t per_block = row_items > 1 ? (ahead_lines + (row_items - 1) * kbs - 1) / ((row_items - 1) * kbs) : 0;
  for (int64_t kb = 0; kb < kbs; ++kb) {
    if (j >= 1) {
      const int64_t start = ((j - 1) * kbs + kb) * per_block, stop = std::min(start + per_block, ahead_lines);
      for (int64_t line = start; line < stop; ++line) _mm_prefetch(ahead + line * 64, _MM_HINT_T1);
    }
    // NOTE: tileloadd from memory waits out the latency of each B operand in turn: where a
    // pair's weights were not fetched ahead (the first rows of a chunk), they are here,
    // kPrefetch blocks ahead. (30 layers' GEMMs of a 256-row prompt: 88 ms with neither
    // prefetch, 79 with this one, 61 with both.)
    if (first && kb + kPrefetch < kbs) {
      for (int line = 0; line < 16; ++line) {
        _mm_prefetch(reinterpret_cast<const char*>(w0 + (kb + kPrefetch) * 512 + line * 32), _MM_HINT_T0);
        if (two_tiles) _mm_prefetch(reinterpret_cast<const char*>(w1 + (kb + kPrefetch) * 512 + line * 32), _MM_HINT_T0);
      }
    }
    // All four operands, then the four products (loads between products stalled them).
    _tile_loadd(0, xb + r0 * kp + kb * 32, kp * 2);
    if (two_rows) _tile_loadd(1, xb + (r0 + 16) * kp + kb * 32, kp * 2);
    _tile_loadd(2, w0 + kb * 512, 64);
    if (two_tiles) _tile_loadd(3, w1 + kb * 512, 64);
    _tile_dpbf16ps(4, 0, 2);
    if (two_tiles) _tile_dpbf16ps(5, 0, 3);
    if (two_rows) {
      _tile_dpbf16ps(6, 1, 2);
      if (two_tiles) _tile_dpbf16ps(7, 1, 3);
    }
  }
  store_c_tiles(y, m, n, r0, t0, buf);
}

// The C tiles 4-7 (rows r0.. x output tiles t0, t0 + 1) into y's valid rows and columns,
// through buf (4 x 256 floats).
__attribute__((target("amx-tile,avx512f"))) void store_c_tiles(float* y, int64_t m, int64_t n, int64_t r0, int64_t t0,
                                                              float* buf) {
  _tile_stored(4, buf, 64);
  _tile_stored(5, buf + 256, 64);
  _tile_stored(6, buf + 512, 64);
  _tile_stored(7, buf + 768, 64);
  for (int rb = 0; rb < 2; ++rb) {
    for (int tb = 0; tb < 2; ++tb) {
      const int64_t cols = std::min<int64_t>(16, n - (t0 + tb) * 16);
      if (cols <= 0) continue;
      // (Masked vector stores: a memcpy of a variable size per row was a libc call each,
      // about a third of the time at 256 rows.)
      const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t row = r0 + rb * 16 + i;
        if (row >= m) break;
        _mm512_mask_storeu_ps(y + row * n + (t0 + tb) * 16, mask,
                              _mm512_load_ps(buf + (2 * rb + tb) * 256 + i * 16));
      }
    }
  }
}

__attribute__((target("amx-tile"))) void release_tiles() { _tile_release(); }

// n floats -> bfloat16, rounded to nearest even (vcvtneps2bf16: every CPU with AMX-BF16 has
// AVX512-BF16).
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void row_to_bf16(uint16_t* dst, const float* src, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
  if (i < n) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m256i v = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, src + i));
    _mm256_mask_storeu_epi16(dst + i, mask, v);
  }
}

// x << S for S >= 0, x >> -S otherwise (32-bit lanes).
template <int S>
__attribute__((target("avx512f"))) inline __m512i shift_lanes(__m512i x) {
  if constexpr (S >= 0) return _mm512_slli_epi32(x, S);
  else return _mm512_srli_epi32(x, -S);
}

// B row p of one 16 x 32 block (pack_w4a16's layout): the nibble of lane L at bits
// 4n..4n+3, n = 2 * (p % 4) + h, is the code of output 8h + L/2, input 2p + L%2. Moved to
// bits 19..22 of 1.0f it is the float 1 + q/16 (two instructions, no conversion), and
// w = (1 + q/16) * D + M with D = 16d, M = m - 16d (pack time) is d * q + m.
template <int N>
__attribute__((target("avx512f"))) inline __m512 code_as_float(__m512i codes) {
  const __m512i mask = _mm512_set1_epi32(0x00780000), one = _mm512_set1_epi32(0x3F800000);
  // (x & mask) | one
  return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(shift_lanes<19 - 4 * N>(codes), mask, one, 0xEA));
}

// Lane L -> output first + L/2: per-output scales spread over a B row's lanes, whose
// vcvtne2ps2bf16 words are outputs 0..7 (then 8..15) two inputs each.
__attribute__((target("avx512f"))) inline __m512i half_outputs(int first) {
  return _mm512_add_epi32(_mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0), _mm512_set1_epi32(first));
}

template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) inline void w4_row(uint16_t* dst, __m512i codes,
                                                                                   __m512 db, __m512 mb, __m512 da,
                                                                                   __m512 ma) {
  const __m512 lo = _mm512_fmadd_ps(code_as_float<2 * R>(codes), db, mb);      // outputs 0..7
  const __m512 hi = _mm512_fmadd_ps(code_as_float<2 * R + 1>(codes), da, ma);  // outputs 8..15
  // words 0..15 from lo, 16..31 from hi: output o's pair at words 2o, 2o + 1
  _mm512_store_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

// `groups` 16 x 32 blocks of 4-bit weights (pack_w4a16: codes [4][64] bytes, then D[16]
// and M[16] per block) as bfloat16 B operands [groups][16 pairs][16 outputs][2], each
// weight (1 + q/16) * D + M in float32 (one fused multiply-add) rounded to bfloat16
// (RNE). About 9 vector instructions per B row, half of them fused multiply-add or
// conversion: this, not the AMX unit, bounds a decode-sized call.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void w4_blocks_to_bf16(uint16_t* dst,
                                                                                       const uint8_t* codes,
                                                                                       const float* scales,
                                                                                       int64_t groups) {
  const __m512i lo_idx = half_outputs(0), hi_idx = half_outputs(8);
  for (int64_t g = 0; g < groups; ++g) {
    const __m512 d = _mm512_loadu_ps(scales + g * 32), m = _mm512_loadu_ps(scales + g * 32 + 16);
    const __m512 db = _mm512_permutexvar_ps(lo_idx, d), mb = _mm512_permutexvar_ps(lo_idx, m);
    const __m512 da = _mm512_permutexvar_ps(hi_idx, d), ma = _mm512_permutexvar_ps(hi_idx, m);
    uint16_t* out = dst + g * 512;
    for (int v = 0; v < 4; ++v) {
      const __m512i c = _mm512_loadu_si512(codes + g * 256 + v * 64);
      w4_row<0>(out + (4 * v + 0) * 32, c, db, mb, da, ma);
      w4_row<1>(out + (4 * v + 1) * 32, c, db, mb, da, ma);
      w4_row<2>(out + (4 * v + 2) * 32, c, db, mb, da, ma);
      w4_row<3>(out + (4 * v + 3) * 32, c, db, mb, da, ma);
    }
  }
}

// `groups` 16 x 32 blocks of 8-bit weights as bfloat16 B operands, each weight d * q (+ m)
// in float32 (one multiply, or one fused multiply-add: d * q is exact for a GGUF type's
// scales, so either rounds once, as llama.cpp's dequantisation does) rounded to bfloat16
// (RNE). Per block: 16 B rows of 32 int8 codes (output L/2's, then output 8 + L/2's, for
// input pair p), then the scales: for each of kHalves input halves (B rows 0-7 take inputs
// 0-15, rows 8-15 inputs 16-31), d[16] and, if kAffine, m[16]. kHalves = 1, no m:
// pack_w8a16 (Q8_0's codes); kHalves = 2: GGUF's 16-input sub-blocks (Q6_K, Q3_K, Q2_K);
// kAffine: the types with a minimum (Q5_1, Q5_K, Q2_K).
template <int kHalves, bool kAffine>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void w8_blocks_to_bf16(uint16_t* dst,
                                                                                       const uint8_t* codes,
                                                                                       const float* scales,
                                                                                       int64_t groups) {
  constexpr int kHalfFloats = kAffine ? 32 : 16, kBlockFloats = kHalves * kHalfFloats;
  const __m512i lo_idx = half_outputs(0), hi_idx = half_outputs(8);
  for (int64_t g = 0; g < groups; ++g) {
    for (int h = 0; h < kHalves; ++h) {
      const float* sc = scales + g * kBlockFloats + h * kHalfFloats;
      const __m512 d = _mm512_loadu_ps(sc);
      const __m512 dlo = _mm512_permutexvar_ps(lo_idx, d), dhi = _mm512_permutexvar_ps(hi_idx, d);
      __m512 mlo = _mm512_setzero_ps(), mhi = _mm512_setzero_ps();
      if constexpr (kAffine) {
        const __m512 m = _mm512_loadu_ps(sc + 16);
        mlo = _mm512_permutexvar_ps(lo_idx, m);
        mhi = _mm512_permutexvar_ps(hi_idx, m);
      }
      const int p0 = kHalves == 1 ? 0 : 8 * h, p1 = kHalves == 1 ? 16 : 8 * h + 8;
      for (int p = p0; p < p1; ++p) {
        const uint8_t* row = codes + g * 512 + p * 32;
        const __m512 qlo =
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row))));
        const __m512 qhi =
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16))));
        __m512 lo, hi;
        if constexpr (kAffine) {
          lo = _mm512_fmadd_ps(qlo, dlo, mlo);
          hi = _mm512_fmadd_ps(qhi, dhi, mhi);
        } else {
          lo = _mm512_mul_ps(qlo, dlo);
          hi = _mm512_mul_ps(qhi, dhi);
        }
        _mm512_store_si512(dst + g * 512 + p * 32, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
      }
    }
  }
}

// Folded formats (kAmxF4, kAmxF8, kAmxF8G16): the B operands hold each code u (of b <= 7
// bits) as the bfloat16 1 + u/2^b, exact, and the scales are applied to each 32 (or 16)
// inputs' tile product afterwards (fold_rows): y += D * C + M * sum(x), D = 2^b d and
// M = m - (o + 2^b) d for w = d * (u - o) + m. Making a B row is then a zero-extension and an
// OR (2-3 instructions per 32 weights, against 9-10 that scale and round each weight), and
// the weights keep every bit of d and m: only x is rounded to bfloat16.
constexpr uint16_t kOneBf16 = 0x3F80;

// kAmxF4: per block 8 chunks of 32 bytes; byte j of chunk c holds word j of B row c in its
// low nibble and of B row c + 8 in its high one (models/gguf_linear.py pack_amx).
__attribute__((target("avx512f,avx512bw"))) void f4_blocks_to_bf16(uint16_t* dst, const uint8_t* codes,
                                                                   const float*, int64_t groups) {
  const __m512i mask = _mm512_set1_epi16(0x78), one = _mm512_set1_epi16(kOneBf16);
  for (int64_t g = 0; g < groups; ++g) {
    for (int c = 0; c < 8; ++c) {
      const __m512i v =
          _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + g * 256 + c * 32)));
      // (v << 3 & 0x78) | 1.0: the low nibble as the top 4 of the 7 mantissa bits; then the high one
      _mm512_store_si512(dst + g * 512 + c * 32, _mm512_ternarylogic_epi32(_mm512_slli_epi16(v, 3), mask, one, 0xEA));
      _mm512_store_si512(dst + g * 512 + (c + 8) * 32,
                         _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 1), mask, one, 0xEA));
    }
  }
}

// kAmxF8 (kHalves = 1) and kAmxF8G16 (2): pack_w8a16's layout of bytes u << (7 - b) (below
// 128), each the mantissa of 1 + u/2^b. With scales per 16 inputs each block is two B
// operands, B rows 0-7 (inputs 0-15) in the first and 8-15 in the second, the other rows
// zero, so that each half's products sum in a C tile of their own.
template <int kHalves>
__attribute__((target("avx512f,avx512bw"))) void f8_blocks_to_bf16(uint16_t* dst, const uint8_t* codes,
                                                                   const float*, int64_t groups) {
  const __m512i one = _mm512_set1_epi16(kOneBf16), zero = _mm512_setzero_si512();
  for (int64_t g = 0; g < groups; ++g) {
    uint16_t* out = dst + g * 512 * kHalves;
    for (int p = 0; p < 16; ++p) {
      const __m512i v =
          _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + g * 512 + p * 32)));
      const __m512i w = _mm512_or_si512(v, one);
      if constexpr (kHalves == 1) {
        _mm512_store_si512(out + p * 32, w);
      } else {
        const int h = p / 8;
        _mm512_store_si512(out + h * 512 + p * 32, w);
        _mm512_store_si512(out + (1 - h) * 512 + p * 32, zero);
      }
    }
  }
}

// acc[r] += D * c[r] + M * xs[r]: a folded tile product of `rows` rows (c: the C tile as
// stored) into its accumulators. xs: each row's sum of the inputs the product covered,
// every `stride` floats. The same two roundings in the same order for a row whatever the
// batch.
__attribute__((target("avx512f"))) inline void fold_rows(float* acc, const float* c, int64_t rows, __m512 d,
                                                        __m512 mo, const float* xs, int64_t stride) {
  for (int64_t r = 0; r < rows; ++r) {
    __m512 a = _mm512_fmadd_ps(_mm512_load_ps(c + r * 16), d, _mm512_load_ps(acc + r * 16));
    _mm512_store_ps(acc + r * 16, _mm512_fmadd_ps(mo, _mm512_set1_ps(xs[r * stride]), a));
  }
}

// Each row's sums of its bfloat16 inputs per 16 (s16, [rows][kp / 16]) and per 32 (s32 =
// s16[2j] + s16[2j + 1]): the M terms of fold_rows. One fixed order of additions.
struct FoldSums {
  const float* s16 = nullptr;
  const float* s32 = nullptr;
  int64_t k16 = 0, k32 = 0;
};

__attribute__((target("avx512f,avx512bw"))) FoldSums fold_sums(const uint16_t* xb, int64_t rows, int64_t kp) {
  thread_local std::vector<float> v;
  const int64_t k16 = kp / 16, k32 = kp / 32;
  if (v.size() < static_cast<size_t>(rows * (k16 + k32))) v.resize(static_cast<size_t>(rows * (k16 + k32)));
  float* s16 = v.data();
  float* s32 = s16 + rows * k16;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < k16; ++j) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + r * kp + j * 16));
      s16[r * k16 + j] = _mm512_reduce_add_ps(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
    }
    for (int64_t j = 0; j < k32; ++j) s32[r * k32 + j] = s16[r * k16 + 2 * j] + s16[r * k16 + 2 * j + 1];
  }
  return {s16, s32, k16, k32};
}

// 16 bytes as 16 floats (a lambda would not inherit the caller's target: the AVX2 builds
// compile this file without AVX-512 by default).
__attribute__((target("avx512f"))) inline __m512 bytes_as_floats(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// How a folded segment keeps its scales: D[16] and M[16] per block half; D[16] per half with
// M = -1.5 D (codes u - 2^(b-1), no offset: Q6_K, Q3_K); or Q4_K's own: per 8 blocks (a
// super-block of 256 inputs) 8 x 16 bytes of 6-bit scales sc, 8 x 16 of minimums mn, then
// 16d[16] and dmin[16] in float32, D = 16d * sc and M = -(dmin * mn) - D (96 floats, 12 per
// block: 0.09 bytes a weight where D and M took 0.25). Each gives the D and M its segment's
// repack would store, bit for bit (16d * sc and dmin * mn are exact, M rounds once).
enum FoldScales : int { kScalesDM = 0, kScalesSym = 1, kScalesQ4K = 2 };

// One row range of a quantised weight as the kernel reads it: per 16 x 32 block,
// `code_bytes` of codes and `scale_floats` scales, and `make`, which turns consecutive
// blocks into B operands.
struct QuantSegment {
  const uint8_t* codes;
  const float* scales;
  int64_t code_bytes, scale_floats;
  void (*make)(uint16_t* dst, const uint8_t* codes, const float* scales, int64_t groups);
  int64_t first_tile;  // the segment's first 16-output tile in the whole weight
  int fold;            // 0: scales in the operands; 1, 2: folded per 32, per 16 inputs (B operands per block)
  int scale_kind;      // a folded segment's scales: FoldScales
};

// A quantised weight of up to kMaxSegments row ranges (a fused projection whose parts a
// GGUF file stores in different types, e.g. Q4_K queries beside Q6_K values), each in its
// own format, `kbs` blocks of 32 inputs per tile. Block b is tile b / kbs's block b % kbs.
constexpr int kMaxSegments = 4;
struct QuantBlocks {
  QuantSegment seg[kMaxSegments];
  int count;
  int64_t kbs;
  int ops;  // B operands per block at most: 2 where a segment folds per 16 inputs

  const QuantSegment& of(int64_t block, int64_t& local) const {
    const int64_t tile = block / kbs;
    int i = count - 1;
    while (i > 0 && tile < seg[i].first_tile) --i;
    local = block - seg[i].first_tile * kbs;
    return seg[i];
  }
  // The folding of the tile's segment (QuantSegment::fold).
  int fold_of(int64_t tile) const {
    int64_t local;
    return of(tile * kbs, local).fold;
  }
  // D and M of half h of a folded block (FoldScales).
  __attribute__((target("avx512f"))) void fold_scales(int64_t block, int h, __m512& d, __m512& mo) const {
    int64_t local;
    const QuantSegment& s = of(block, local);
    if (s.scale_kind == kScalesQ4K) {
      const float* rec = s.scales + (local / 8) * 96;
      const auto* ints = reinterpret_cast<const uint8_t*>(rec) + (local % 8) * 16;
      d = _mm512_mul_ps(_mm512_loadu_ps(rec + 64), bytes_as_floats(ints));
      mo = _mm512_fnmsub_ps(_mm512_loadu_ps(rec + 80), bytes_as_floats(ints + 128), d);
      return;
    }
    const float* sc = s.scales + local * s.scale_floats;
    if (s.scale_kind == kScalesSym) {
      d = _mm512_loadu_ps(sc + 16 * h);
      mo = _mm512_mul_ps(d, _mm512_set1_ps(-1.5f));
    } else {
      d = _mm512_loadu_ps(sc + 32 * h);
      mo = _mm512_loadu_ps(sc + 32 * h + 16);
    }
  }
  // `blocks` consecutive blocks from `block`, all of one tile (folded per 16 inputs: two
  // B operands per block).
  void to_bf16(uint16_t* dst, int64_t block, int64_t blocks) const {
    int64_t local;
    const QuantSegment& s = of(block, local);
    s.make(dst, s.codes + local * s.code_bytes, s.scales + local * s.scale_floats, blocks);
  }
  void prefetch(int64_t block) const {
    int64_t local;
    const QuantSegment& s = of(block, local);
    const char* c = reinterpret_cast<const char*>(s.codes + local * s.code_bytes);
    const char* sc = reinterpret_cast<const char*>(
        s.scales + (s.scale_kind == kScalesQ4K ? (local / 8) * 96 : local * s.scale_floats));
    for (int64_t b = 0; b < s.code_bytes; b += 64) _mm_prefetch(c + b, _MM_HINT_T0);
    for (int64_t b = 0; b < s.scale_floats * 4; b += 64) _mm_prefetch(sc + b, _MM_HINT_T0);
  }
};

// The C tile 3 + i: zeroed, or stored to buf (tile numbers are immediates).
__attribute__((target("amx-tile"))) inline void zero_c(int i) {
  switch (i) {
    case 0: _tile_zero(3); break;
    case 1: _tile_zero(4); break;
    case 2: _tile_zero(5); break;
    case 3: _tile_zero(6); break;
    default: _tile_zero(7); break;
  }
}

__attribute__((target("amx-tile"))) inline void store_c(int i, float* buf) {
  switch (i) {
    case 0: _tile_stored(3, buf, 64); break;
    case 1: _tile_stored(4, buf, 64); break;
    case 2: _tile_stored(5, buf, 64); break;
    case 3: _tile_stored(6, buf, 64); break;
    default: _tile_stored(7, buf, 64); break;
  }
}

// Decode-sized batches (m <= 16 rows, tiles configured to m rows: configure_small_tiles)
// x kSmallTiles output tiles from t0 on, from quantised weights, none reused by another row
// block. Each 32-input block's B operands are made bfloat16 one block ahead of their
// products, into L1 (a tile load right after the stores that wrote it waits on them).
// Five C tiles work side by side: each tdpbf16ps waits for the last one into its tile,
// and amx_bf16_item's two chains at one row block left the unit idle. A tile whose
// scales are in its operands sums its blocks in its C tile in order from zero
// (amx_bf16_item's result); a folded one sums each block (half) from zero and folds it
// into acc (fold_rows), as quant_fold_item does for larger batches.
constexpr int kSmallTiles = 5;

// Tile B <- the B operand at w (16 x 64 bytes); tile C += tile 0 (A) x tile B. (A macro:
// the tile intrinsics take their tile numbers as literal text.)
#define KVSERVE_LOAD_AND_DOT(B, C, w) \
  do {                                \
    _tile_loadd(B, (w), 64);          \
    _tile_dpbf16ps(C, 0, B);          \
  } while (0)
constexpr int64_t kCodePrefetch = 4;  // quantised blocks fetched ahead (measured: 2-8 alike)

// C tile 3 + i (zeroed first if `fresh`) += A x the B operand at w, through B tile 1 or 2
// (alternating, so a load need not wait for the product reading the other).
__attribute__((target("amx-tile,amx-bf16"))) inline void dot_c(int i, const uint16_t* w, bool fresh) {
  if (fresh) zero_c(i);
  switch (i) {
    case 0: KVSERVE_LOAD_AND_DOT(1, 3, w); break;
    case 1: KVSERVE_LOAD_AND_DOT(2, 4, w); break;
    case 2: KVSERVE_LOAD_AND_DOT(1, 5, w); break;
    case 3: KVSERVE_LOAD_AND_DOT(2, 6, w); break;
    default: KVSERVE_LOAD_AND_DOT(1, 7, w); break;
  }
}

__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16"))) void quant_item_small(
    float* y, int64_t m, int64_t n, const uint16_t* xb, int64_t kp, const QuantBlocks& qb, int64_t kbs,
    int64_t tiles, int64_t t0, uint16_t* wbuf, float* buf, float* acc, const FoldSums& xs) {
  const int nt = static_cast<int>(std::min<int64_t>(kSmallTiles, tiles - t0));
  int fold[kSmallTiles];
  for (int i = 0; i < nt; ++i) {
    fold[i] = qb.fold_of(t0 + i);
    if (fold[i]) std::memset(acc + i * 256, 0, m * 64);
    else zero_c(i);
  }
  // Block kb's operands: tile i's at wbuf + ((kb & 1) * kSmallTiles + i) * per_tile (two B
  // operands per tile where a segment folds per 16 inputs; one keeps the buffer in half of L1).
  const int64_t per_tile = qb.ops * 512;
  const auto operands = [&](int64_t kb, int i) { return wbuf + ((kb & 1) * kSmallTiles + i) * per_tile; };
  const auto make = [&](int64_t kb) {
    for (int i = 0; i < nt; ++i) {
      const int64_t blk = (t0 + i) * kbs + kb;
      if (kb + kCodePrefetch < kbs) qb.prefetch(blk + kCodePrefetch);
      qb.to_bf16(operands(kb, i), blk, 1);
    }
  };
  make(0);
  for (int64_t kb = 0; kb < kbs; ++kb) {
    if (kb + 1 < kbs) make(kb + 1);
    _tile_loadd(0, xb + kb * 32, kp * 2);
    for (int i = 0; i < nt; ++i) dot_c(i, operands(kb, i), fold[i] != 0);
    for (int i = 0; i < nt; ++i) {
      if (!fold[i]) continue;
      __m512 d, mo;
      qb.fold_scales((t0 + i) * kbs + kb, 0, d, mo);
      store_c(i, buf);
      if (fold[i] == 1) {
        fold_rows(acc + i * 256, buf, m, d, mo, xs.s32 + kb, xs.k32);
      } else {
        fold_rows(acc + i * 256, buf, m, d, mo, xs.s16 + 2 * kb, xs.k16);
        dot_c(i, operands(kb, i) + 512, true);
      }
    }
    for (int i = 0; i < nt; ++i) {
      if (fold[i] != 2) continue;
      __m512 d, mo;
      qb.fold_scales((t0 + i) * kbs + kb, 1, d, mo);
      store_c(i, buf);
      fold_rows(acc + i * 256, buf, m, d, mo, xs.s16 + 2 * kb + 1, xs.k16);
    }
  }
  for (int i = 0; i < nt; ++i) {
    const float* src = acc + i * 256;
    if (!fold[i]) {
      store_c(i, buf);
      src = buf;
    }
    const int64_t cols = std::min<int64_t>(16, n - (t0 + i) * 16);
    const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
    for (int64_t r = 0; r < m; ++r) _mm512_mask_storeu_ps(y + r * n + (t0 + i) * 16, mask, _mm512_load_ps(src + r * 16));
  }
}

// One 32-input block of a folded tile for the 16 rows of A tile 0: its kOps products (C
// tiles C0, C1; B tiles 2, 3) stored to buf and folded into acc, kept in registers:
// fold_rows' two roundings in its order, without acc's trips through memory (a third of
// the time of a 256-row prompt's projections). A macro: GCC's tile intrinsics paste their
// tile numbers into the assembly as text, so they cannot be template parameters.
#define KVSERVE_FOLD_PRODUCTS(C0, C1)  \
  do {                                 \
    _tile_loadd(2, w, 64);             \
    _tile_zero(C0);                    \
    _tile_dpbf16ps(C0, 0, 2);          \
    if (kOps == 2) {                   \
      _tile_loadd(3, w + 512, 64);     \
      _tile_zero(C1);                  \
      _tile_dpbf16ps(C1, 0, 3);        \
    }                                  \
    _tile_stored(C0, buf, 64);         \
    if (kOps == 2) _tile_stored(C1, buf + 256, 64); \
  } while (0)

template <int kOps>
__attribute__((target("amx-tile,amx-bf16,avx512f"), always_inline)) inline void fold_block(
    __m512* acc, const uint16_t* w, const QuantBlocks& qb, int64_t block, const float* xs, int64_t stride,
    float* buf, bool odd) {
  if (odd) KVSERVE_FOLD_PRODUCTS(6, 7);
  else KVSERVE_FOLD_PRODUCTS(4, 5);
  for (int h = 0; h < kOps; ++h) {
    __m512 d, mo;
    qb.fold_scales(block, h, d, mo);
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_load_ps(buf + 256 * h + r * 16), d, acc[r]);
      acc[r] = _mm512_fmadd_ps(mo, _mm512_set1_ps(xs[r * stride + h]), acc[r]);
    }
  }
}
#undef KVSERVE_FOLD_PRODUCTS

// Larger batches, one folded output tile t for rows [r0, r0 + 16) (padded to whole items),
// its B operands made at w (kOps per block). Consecutive blocks alternate between C tiles
// 4-5 and 6-7 and between two halves of buf (4 x 256 floats), so one block's products need
// not wait for the last one's to be stored. Tiles: 0 A, 2-3 B, 4-7 C, 16 x 64 bytes.
template <int kOps>
__attribute__((target("amx-tile,amx-bf16,avx512f"))) void fold_tile_rows(
    float* y, int64_t m, int64_t n, const uint16_t* xb, int64_t kp, const uint16_t* w, const QuantBlocks& qb,
    int64_t kbs, int64_t t, int64_t r0, const FoldSums& xs, float* buf) {
  __m512 acc[16];
  for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t stride = kOps == 2 ? xs.k16 : xs.k32;
  const float* xr = (kOps == 2 ? xs.s16 : xs.s32) + r0 * stride;
  for (int64_t kb = 0; kb < kbs; ++kb) {
    _tile_loadd(0, xb + r0 * kp + kb * 32, kp * 2);
    fold_block<kOps>(acc, w + kb * kOps * 512, qb, t * kbs + kb, xr + kb * kOps, stride, buf + (kb % 2) * 512,
                     kb % 2);
  }
  const int64_t cols = std::min<int64_t>(16, n - t * 16);
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
  for (int r = 0; r < 16 && r0 + r < m; ++r) _mm512_mask_storeu_ps(y + (r0 + r) * n + t * 16, mask, acc[r]);
}

// Larger batches, one tile t of a 32-row item whose scales are in its operands, beside a
// folded one: its C tiles sum all blocks in order from zero (amx_bf16_item's arithmetic).
__attribute__((target("amx-tile,amx-bf16,avx512f"))) void plain_tile_rows(
    float* y, int64_t m, int64_t n, const uint16_t* xb, int64_t kp, const uint16_t* w, int64_t kbs, int64_t t,
    int64_t r0, float* buf) {
  _tile_zero(4);
  _tile_zero(6);
  for (int64_t kb = 0; kb < kbs; ++kb) {
    _tile_loadd(0, xb + r0 * kp + kb * 32, kp * 2);
    _tile_loadd(1, xb + (r0 + 16) * kp + kb * 32, kp * 2);
    _tile_loadd(2, w + kb * 512, 64);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(6, 1, 2);
  }
  _tile_stored(4, buf, 64);
  _tile_stored(6, buf + 256, 64);
  const int64_t cols = std::min<int64_t>(16, n - t * 16);
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
  for (int64_t r = 0; r < 32 && r0 + r < m; ++r)
    _mm512_mask_storeu_ps(y + (r0 + r) * n + t * 16, mask, _mm512_load_ps(buf + r * 16));
}

// Tile t of a 32-row item (r0), folded (fold 1 or 2) or not.
void quant_tile_item(float* y, int64_t m, int64_t n, const uint16_t* xb, int64_t kp, const uint16_t* w, int fold,
                     const QuantBlocks& qb, int64_t kbs, int64_t t, int64_t r0, const FoldSums& xs, float* buf) {
  if (!fold) return plain_tile_rows(y, m, n, xb, kp, w, kbs, t, r0, buf);
  for (int64_t r = r0; r < r0 + 32 && r < m; r += 16) {
    if (fold == 1) fold_tile_rows<1>(y, m, n, xb, kp, w, qb, kbs, t, r, xs, buf);
    else fold_tile_rows<2>(y, m, n, xb, kp, w, qb, kbs, t, r, xs, buf);
  }
}
#endif

}  // namespace

bool amx_bf16_available() {
#if defined(__x86_64__)
  // amx_tiles_granted() asks the OS for the tile state once (one permission serves all of AMX).
  static const bool ok = cpu_has_amx_bf16() && amx_tiles_granted();
  return ok;
#else
  return false;
#endif
}

#if defined(__x86_64__)
// amx_bf16_item's work for mp rows (a multiple of kRowsPerItem) x `tiles` output tiles:
// f(t0, r0, first, buf) for each item, `first` for a chunk's first, inside the tile
// configuration, buf 4 x 256 floats for the C tiles.
// Items run the row blocks fastest within a pair of output tiles: the pair's weights
// (K x 32 bfloat16, tens of KB) stay in L1/L2 for all rows, and the rows (M x K
// bfloat16) in L2; each weight is read from memory once per call. (Rows fastest
// across the tiles streamed a layer's 7 MB once per 32 rows.)
// NOTE: the tile configuration (ldtilecfg, then tilerelease) is per chunk: per item or
// per tile pair it cost up to 2x the time at 16 rows. So a chunk is whole tile pairs,
// about four chunks a thread (idle threads still take over a slow one's).
template <typename F>
void for_each_pair_item(int64_t mp, int64_t tiles, F&& f) {
  const int64_t row_items = mp / kRowsPerItem, tile_items = (tiles + kTilesPerItem - 1) / kTilesPerItem;
  const int64_t pairs_per_chunk = std::max<int64_t>(1, tile_items / (4 * at::get_num_threads()));
  parallel_chunks(row_items * tile_items, row_items * pairs_per_chunk, [&](int64_t begin, int64_t end) {
    configure_bf16_tiles();
    alignas(64) float buf[4 * 256];
    for (int64_t item = begin; item < end; ++item)
      f((item / row_items) * kTilesPerItem, (item % row_items) * kRowsPerItem, item == begin, buf);
    release_tiles();
  });
}
#endif

#if defined(__x86_64__)
// x's rows as bfloat16 (RNE) for A tiles: rows padded to mp and inputs to kp with zeros
// (their products add 0), in the calling thread's buffer, kept between calls (no
// allocation per call). Bfloat16 rows the tiles can read as they are are not copied.
static const uint16_t* bf16_rows(const at::Tensor& x, int64_t mp, int64_t kp) {
  const int64_t m = x.size(0), k = x.size(1), xs = x.stride(0);
  const bool f32 = x.scalar_type() == at::kFloat;
  const float* xf = f32 ? x.data_ptr<float>() : nullptr;
  const auto* xh = f32 ? nullptr : reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  if (!f32 && m == mp && k == kp && xs == k) return xh;
  thread_local std::vector<uint16_t> xb;
  if (xb.size() < static_cast<size_t>(mp * kp)) xb.resize(static_cast<size_t>(mp * kp));
  uint16_t* xbp = xb.data();
  const auto convert = [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      uint16_t* dst = xbp + r * kp;
      if (r >= m) {
        std::memset(dst, 0, kp * 2);
        continue;
      }
      if (f32) row_to_bf16(dst, xf + r * xs, k);
      else std::memcpy(dst, xh + r * xs, k * 2);
      std::memset(dst + k, 0, (kp - k) * 2);
    }
  };
  if (mp * kp <= 64 * 1024) convert(0, mp);  // a few rows convert faster than a parallel region starts
  else parallel_chunks(mp, 16, convert);
  return xbp;
}
#endif

// The checks both entry points share: x [M, K] float32 (or bfloat16 where allowed) with
// contiguous rows, out [M, N] float32, N within `tiles` 16-output tiles.
static void check_rows(const char* name, const at::Tensor& out, const at::Tensor& x, int64_t tiles, bool bf16_x) {
  TORCH_CHECK(amx_bf16_available(), name, " needs AMX-BF16 (the CPU's and the OS's permission)");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 &&
                  (x.scalar_type() == at::kFloat || (bf16_x && x.scalar_type() == at::kBFloat16)),
              "x must be [M, K] float32", bf16_x ? " or bfloat16" : "", " with contiguous rows");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.scalar_type() == at::kFloat && out.size(0) == x.size(0),
              "out must be contiguous [M, N] float32");
  TORCH_CHECK(tiles * 16 >= out.size(1) && (tiles - 1) * 16 < out.size(1),
              "out's width does not match the packed weight");
}

void amx_bf16_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 5 && w.is_contiguous() && w.scalar_type() == at::kBFloat16 && w.size(2) == 16 &&
                  w.size(3) == 16 && w.size(4) == 2,
              "w must be packed by pack_amx_bf16: [N/16, K/32, 16, 16, 2] bfloat16");
  check_rows("amx_bf16_linear", out, x, w.size(0), true);
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1), tiles = w.size(0), kbs = w.size(1);
  TORCH_CHECK(kbs * 32 >= k && (kbs - 1) * 32 < k, "w's input blocks do not match x's width");
  if (m == 0) return;
#if defined(__x86_64__)
  const int64_t kp = kbs * 32, mp = (m + kRowsPerItem - 1) / kRowsPerItem * kRowsPerItem;
  const uint16_t* xbp = bf16_rows(x, mp, kp);
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  float* yp = out.data_ptr<float>();
  const int64_t row_items = mp / kRowsPerItem;
  for_each_pair_item(mp, tiles, [&](int64_t t0, int64_t r0, bool first, float* buf) {
    const int64_t ahead_lines = t0 + 2 < tiles ? 16 * kbs * std::min<int64_t>(2, tiles - t0 - 2) : 0;
    amx_bf16_item(yp, m, n, xbp, kp, wp + t0 * kbs * 512, wp + (t0 + 1) * kbs * 512, kbs, tiles, r0, t0, buf,
                  first || row_items == 1, reinterpret_cast<const char*>(wp + (t0 + 2) * kbs * 512), ahead_lines,
                  row_items);
  });
#endif
}

#if defined(__x86_64__)
// y = x @ W^T for a quantised W (amx_w4a16_linear, amx_w8a16_linear, amx_quant_linear):
// the blocks made bfloat16 B operands in the kernel, amx_bf16_linear's tile products, a
// folded segment's scales applied per block (fold_rows).
static void amx_quant_linear(at::Tensor& out, const at::Tensor& x, const QuantBlocks& qb, int64_t tiles,
                             int64_t kbs) {
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1);
  TORCH_CHECK(kbs * 32 == k, "the weight's groups do not match x's width");
  if (m == 0) return;
  float* yp = out.data_ptr<float>();
  const int threads = at::get_num_threads();
  bool folded = false;
  for (int i = 0; i < qb.count; ++i) folded |= qb.seg[i].fold != 0;
  if (m <= 16) {  // A tiles of m rows: no padding
    const uint16_t* xbp = bf16_rows(x, m, k);
    const FoldSums xs = folded ? fold_sums(xbp, m, k) : FoldSums{};
    const int64_t items = (tiles + kSmallTiles - 1) / kSmallTiles;
    parallel_chunks(items, std::max<int64_t>(1, items / (4 * threads)), [&](int64_t begin, int64_t end) {
      alignas(64) uint16_t wbuf[2 * kSmallTiles * 1024];
      alignas(64) float buf[256];
      alignas(64) float acc[kSmallTiles * 256];
      configure_small_tiles(static_cast<int>(m));
      for (int64_t item = begin; item < end; ++item)
        quant_item_small(yp, m, n, xbp, k, qb, kbs, tiles, item * kSmallTiles, wbuf, buf, acc, xs);
      release_tiles();
    });
    return;
  }
  // Larger batches: amx_bf16_linear's items, each pair of tiles made bfloat16 (in L2) once
  // for all its row blocks.
  const int64_t mp = (m + kRowsPerItem - 1) / kRowsPerItem * kRowsPerItem;
  const uint16_t* xbp = bf16_rows(x, mp, k);
  const FoldSums xs = folded ? fold_sums(xbp, mp, k) : FoldSums{};
  for_each_pair_item(mp, tiles, [&](int64_t t0, int64_t r0, bool first, float* buf) {
    thread_local std::vector<uint16_t> wb;
    if (wb.size() < static_cast<size_t>(4 * kbs * 512 + 32)) wb.resize(static_cast<size_t>(4 * kbs * 512 + 32));
    uint16_t* w0 = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(wb.data()) + 63) & ~uintptr_t{63});
    uint16_t* w1 = w0 + qb.ops * kbs * 512;
    const bool two = t0 + 1 < tiles;
    if (first || r0 == 0) {
      qb.to_bf16(w0, t0 * kbs, kbs);
      if (two) qb.to_bf16(w1, (t0 + 1) * kbs, kbs);
    }
    const int f0 = qb.fold_of(t0), f1 = two ? qb.fold_of(t0 + 1) : 0;
    if (!f0 && !f1) {
      amx_bf16_item(yp, m, n, xbp, k, w0, w1, kbs, tiles, r0, t0, buf, false, nullptr, 0, mp / kRowsPerItem);
      return;
    }
    quant_tile_item(yp, m, n, xbp, k, w0, f0, qb, kbs, t0, r0, xs, buf);
    if (two) quant_tile_item(yp, m, n, xbp, k, w1, f1, qb, kbs, t0 + 1, r0, xs, buf);
  });
}
#endif

// The formats of amx_quant_linear's segments, by AmxWeightFormat (kernels.h): codes bytes
// and scale floats per block, and the maker.
struct AmxFormat {
  int64_t code_bytes, scale_floats;
  void (*make)(uint16_t* dst, const uint8_t* codes, const float* scales, int64_t groups);
  int fold;        // QuantSegment::fold
  int scale_kind;  // QuantSegment::scale_kind
};
#if defined(__x86_64__)
const AmxFormat kAmxFormats[] = {
    {256, 32, w4_blocks_to_bf16, 0, 0},            // kAmxW4: pack_w4a16
    {512, 16, w8_blocks_to_bf16<1, false>, 0, 0},  // kAmxW8: d per 32 inputs (pack_w8a16)
    {512, 32, w8_blocks_to_bf16<2, false>, 0, 0},  // kAmxW8G16: d per 16 inputs
    {512, 32, w8_blocks_to_bf16<1, true>, 0, 0},   // kAmxW8Affine: d and m per 32 inputs
    {512, 64, w8_blocks_to_bf16<2, true>, 0, 0},   // kAmxW8AffineG16: d and m per 16 inputs
    {256, 32, f4_blocks_to_bf16, 1, 0},            // kAmxF4: 4-bit codes, D and M per 32 inputs
    {512, 32, f8_blocks_to_bf16<1>, 1, 0},         // kAmxF8: codes of up to 7 bits, D and M per 32
    {512, 64, f8_blocks_to_bf16<2>, 2, 0},         // kAmxF8G16: the same per 16 inputs
    {512, 32, f8_blocks_to_bf16<2>, 2, kScalesSym},  // kAmxF8G16Sym: D per 16 inputs, M = -1.5 D
    {256, 12, f4_blocks_to_bf16, 1, kScalesQ4K},     // kAmxF4K: kAmxF4's codes, Q4_K's own scales
};
#endif

void amx_quant_linear(at::Tensor& out, const at::Tensor& x, const std::vector<at::Tensor>& parts,
                      const std::vector<int64_t>& formats) {
  const int count = static_cast<int>(formats.size());
  TORCH_CHECK(count >= 1 && count <= kMaxSegments && parts.size() == 2 * formats.size(),
              "amx_quant_linear takes 1 to ", kMaxSegments, " segments of (codes, scales) and their formats");
  int64_t tiles = 0, kbs = -1;
#if defined(__x86_64__)
  QuantBlocks qb{};
  qb.count = count;
  for (int i = 0; i < count; ++i) {
    TORCH_CHECK(formats[i] >= 0 && formats[i] < static_cast<int64_t>(sizeof(kAmxFormats) / sizeof(kAmxFormats[0])),
                "unknown AMX weight format ", formats[i]);
    const AmxFormat& f = kAmxFormats[formats[i]];
    const at::Tensor& c = parts[2 * i];
    const at::Tensor& sc = parts[2 * i + 1];
    TORCH_CHECK(c.is_contiguous() && (c.scalar_type() == at::kByte || c.scalar_type() == at::kChar) && c.dim() >= 2,
                "segment ", i, "'s codes must be contiguous uint8/int8 [tiles, K/32, ...]");
    TORCH_CHECK(sc.is_contiguous() && sc.scalar_type() == at::kFloat, "segment ", i, "'s scales must be float32");
    TORCH_CHECK(kbs < 0 || c.size(1) == kbs, "segments differ in their input blocks");
    kbs = c.size(1);
    TORCH_CHECK(c.numel() == c.size(0) * kbs * f.code_bytes && sc.numel() == c.size(0) * kbs * f.scale_floats,
                "segment ", i, " does not hold format ", formats[i], "'s bytes for its blocks");
    qb.seg[i] = {reinterpret_cast<const uint8_t*>(c.data_ptr()), sc.data_ptr<float>(), f.code_bytes,
                 f.scale_floats, f.make, tiles, f.fold, f.scale_kind};
    TORCH_CHECK(f.scale_kind != kScalesQ4K || kbs % 8 == 0, "format ", formats[i], " takes whole 256-input super-blocks");
    tiles += c.size(0);
  }
  qb.kbs = kbs;
  qb.ops = 1;
  for (int i = 0; i < count; ++i) qb.ops = std::max(qb.ops, qb.seg[i].fold == 2 ? 2 : 1);
  check_rows("amx_quant_linear", out, x, tiles, false);
  amx_quant_linear(out, x, qb, tiles, kbs);
#else
  TORCH_CHECK(false, "amx_quant_linear needs an x86-64 CPU with AMX-BF16");
#endif
}

#if defined(__x86_64__)
// amx_quant_linear for a weight of one segment in format `fmt`.
static void amx_quant_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& codes,
                             const at::Tensor& scales, AmxWeightFormat fmt) {
  const AmxFormat& f = kAmxFormats[fmt];
  QuantBlocks qb{};
  qb.seg[0] = {reinterpret_cast<const uint8_t*>(codes.data_ptr()), scales.data_ptr<float>(), f.code_bytes,
               f.scale_floats, f.make, 0, f.fold, f.scale_kind};
  qb.count = 1;
  qb.kbs = codes.size(1);
  qb.ops = f.fold == 2 ? 2 : 1;
  amx_quant_linear(out, x, qb, codes.size(0), codes.size(1));
}
#endif

void amx_w4a16_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(codes.dim() == 4 && codes.is_contiguous() && codes.scalar_type() == at::kByte && codes.size(2) == 4 &&
                  codes.size(3) == 64, "codes must be pack_w4a16's [N/16, K/32, 4, 64] uint8");
  TORCH_CHECK(scales.dim() == 4 && scales.is_contiguous() && scales.scalar_type() == at::kFloat &&
                  scales.size(0) == codes.size(0) && scales.size(1) == codes.size(1) && scales.size(2) == 2 &&
                  scales.size(3) == 16, "scales must be pack_w4a16's [N/16, K/32, 2, 16] float32");
  check_rows("amx_w4a16_linear", out, x, codes.size(0), false);
#if defined(__x86_64__)
  amx_quant_linear(out, x, codes, scales, kAmxW4);
#endif
}

void amx_w8a16_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(codes.dim() == 4 && codes.is_contiguous() && codes.scalar_type() == at::kChar && codes.size(2) == 16 &&
                  codes.size(3) == 32, "codes must be pack_w8a16's [N/16, K/32, 16, 32] int8");
  TORCH_CHECK(scales.dim() == 3 && scales.is_contiguous() && scales.scalar_type() == at::kFloat &&
                  scales.size(0) == codes.size(0) && scales.size(1) == codes.size(1) && scales.size(2) == 16,
              "scales must be pack_w8a16's [N/16, K/32, 16] float32");
  check_rows("amx_w8a16_linear", out, x, codes.size(0), false);
#if defined(__x86_64__)
  amx_quant_linear(out, x, codes, scales, kAmxW8);
#endif
}

}  // namespace kvserve

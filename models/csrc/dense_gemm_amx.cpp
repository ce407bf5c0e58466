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

constexpr int64_t kRowsPerItem = 32;  // two 16-row A tiles
constexpr int64_t kTilesPerItem = 2;  // two 16-output B tiles
constexpr int64_t kPrefetch = 4;      // weight blocks fetched ahead

// Rows [r0, r0 + 32) x tiles [t0, t0 + 2) of y, from xb (bfloat16 rows, kp
// inputs each, padded) and the packed weights.
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw"))) void amx_bf16_item(
    float* y, int64_t m, int64_t n, const uint16_t* xb, int64_t kp, const uint16_t* w, int64_t kbs,
    int64_t tiles, int64_t r0, int64_t t0, float* buf, bool first, int64_t row_items) {
  const bool two_rows = r0 + 16 < m, two_tiles = t0 + 1 < tiles;
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  const uint16_t* w0 = w + t0 * kbs * 512;
  const uint16_t* w1 = w + (t0 + 1) * kbs * 512;
  // The next tile pair's weights (they follow this pair's), fetched into L2 a few lines
  // per block by this pair's later row blocks, so its first row block finds them there.
  const int64_t j = r0 / kRowsPerItem, ahead_lines = t0 + 2 < tiles ? 16 * kbs * std::min<int64_t>(2, tiles - t0 - 2) : 0;
  const int64_t per_block = row_items > 1 ? (ahead_lines + (row_items - 1) * kbs - 1) / ((row_items - 1) * kbs) : 0;
  const char* ahead = reinterpret_cast<const char*>(w + (t0 + 2) * kbs * 512);
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

void amx_bf16_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(amx_bf16_available(), "amx_bf16_linear needs AMX-BF16 (the CPU's and the OS's permission)");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be [M, K] float32 or bfloat16 with contiguous rows");
  TORCH_CHECK(w.dim() == 5 && w.is_contiguous() && w.scalar_type() == at::kBFloat16 && w.size(2) == 16 &&
                  w.size(3) == 16 && w.size(4) == 2,
              "w must be packed by pack_amx_bf16: [N/16, K/32, 16, 16, 2] bfloat16");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.scalar_type() == at::kFloat && out.size(0) == x.size(0),
              "out must be contiguous [M, N] float32");
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1), tiles = w.size(0), kbs = w.size(1);
  TORCH_CHECK(kbs * 32 >= k && (kbs - 1) * 32 < k, "w's input blocks do not match x's width");
  TORCH_CHECK(tiles * 16 >= n && (tiles - 1) * 16 < n, "out's width does not match the packed weight");
  if (m == 0) return;
#if defined(__x86_64__)
  // x's rows as bfloat16, rows padded to 32 and inputs to 32 with zeros (their products
  // add 0). The buffer is the calling thread's, kept between calls: no allocation per call.
  const int64_t kp = kbs * 32, mp = (m + kRowsPerItem - 1) / kRowsPerItem * kRowsPerItem;
  thread_local std::vector<uint16_t> xb;
  if (xb.size() < static_cast<size_t>(mp * kp)) xb.resize(static_cast<size_t>(mp * kp));
  uint16_t* xbp = xb.data();
  const int64_t xs = x.stride(0);
  const bool f32 = x.scalar_type() == at::kFloat;
  const float* xf = f32 ? x.data_ptr<float>() : nullptr;
  const auto* xh = f32 ? nullptr : reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
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
  if (!f32 && m == mp && k == kp && xs == k) {
    xbp = const_cast<uint16_t*>(xh);  // bfloat16 rows as the tiles read them already: no copy
  } else if (mp * kp <= 64 * 1024) {
    convert(0, mp);  // a few rows are converted faster than a parallel region starts
  } else {
    parallel_chunks(mp, 16, convert);
  }
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  float* yp = out.data_ptr<float>();
  const int64_t row_items = mp / kRowsPerItem, tile_items = (tiles + kTilesPerItem - 1) / kTilesPerItem;
  // Items run the row blocks fastest within a pair of output tiles: the pair's weights
  // (K x 32 bfloat16, tens of KB) stay in L1/L2 for all rows, and the rows (M x K
  // bfloat16) in L2; each weight is read from memory once per call. (Rows fastest
  // across the tiles streamed a layer's 7 MB once per 32 rows.)
  // NOTE: the tile configuration (ldtilecfg, then tilerelease) is per call of the lambda:
  // per item or per tile pair it cost up to 2x the time at 16 rows. So a chunk is whole
  // tile pairs, about four chunks a thread (idle threads still take over a slow one's).
  const int64_t pairs_per_chunk = std::max<int64_t>(1, tile_items / (4 * at::get_num_threads()));
  parallel_chunks(row_items * tile_items, row_items * pairs_per_chunk, [&](int64_t begin, int64_t end) {
    configure_bf16_tiles();
    alignas(64) float buf[4 * 256];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t0 = (item / row_items) * kTilesPerItem, r0 = (item % row_items) * kRowsPerItem;
      amx_bf16_item(yp, m, n, xbp, kp, wp, kbs, tiles, r0, t0, buf, item == begin || row_items == 1, row_items);
    }
    release_tiles();
  });
#endif
}

}  // namespace kvserve

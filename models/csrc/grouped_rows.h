// What the int8-activation GEMMs share (grouped_gemm.cpp, gguf_a8.cpp): the packed codes'
// tile shape, the rounding of x's rows to int8 per 16 inputs, the integer dots of a
// group's codes with them, and the walk of a weight's tiles over the threads.
// grouped_gemm.cpp describes the layout and the arithmetic.
#pragma once

#include <ATen/Parallel.h>

#include "parallel.h"
#include "vec16.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace kvserve::grouped {

constexpr int64_t kTile = 16;   // output rows per vector
constexpr int64_t kGroup = 32;  // inputs per scale
// Rows of x per pass over a tile. The int8 path keeps one accumulator per row
// in registers and gains about 5% going from 8 to 16 rows; the float path keeps
// two per row and slows down at 16 (measured with AVX-512's 32 registers;
// AVX2 has 16 of half the width). A row's arithmetic does not depend on the
// rows beside it.
#if defined(KVSERVE_V16_AVX2)
constexpr int kRowsFloat = 4;
constexpr int kRowsInt8 = 8;
#else
constexpr int kRowsFloat = 8;
constexpr int kRowsInt8 = 16;
#endif

// Rows of x rounded to 8 bits per half group (16 inputs), for codes of
// centre c (8 for 4 bits, 128 for 8 bits), stored group-major so that a pass
// over a chunk of rows walks one pointer per array: q [groups][rows][32]
// signed codes, d [groups][rows][2], and sum [groups][rows] = sum(x) and
// shift [groups][rows] = c * (sum(x) - dx0 sum(qx_lo) - dx1 sum(qx_hi)) (see tile_rows_a8),
// and qs [groups][rows][2] = sum(qx_lo), sum(qx_hi) (gguf_a8.cpp's formats centre the codes
// with them instead of shift).
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> d, sum, shift;
  std::vector<int32_t> qs;
  int64_t rows;
};

// Row r of x into qr, one half group (16 inputs) at a time.
inline void quantize_row(QuantizedRows& qr, const float* x, int64_t r, int64_t groups, float centre) {
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t gr = g * qr.rows + r;
    float sum = 0.0f, dq = 0.0f;
    for (int h = 0; h < 2; ++h) {
      const float* xh = x + g * kGroup + h * 16;
      int8_t* q = qr.q.data() + gr * kGroup + h * 16;
      float amax = 0.0f;
      for (int k = 0; k < 16; ++k) {
        amax = std::max(amax, std::fabs(xh[k]));
        sum += xh[k];
      }
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      int qsum = 0;
      for (int k = 0; k < 16; ++k) {
        q[k] = static_cast<int8_t>(std::nearbyint(xh[k] * inv));
        qsum += q[k];
      }
      qr.d[2 * gr + h] = amax / 127.0f;
      qr.qs[2 * gr + h] = qsum;
      dq += qr.d[2 * gr + h] * static_cast<float>(qsum);
    }
    qr.sum[gr] = sum;
    qr.shift[gr] = centre * (sum - dq);
  }
}

#if defined(KVSERVE_V16)
// The same rounding, 16 half groups at a time: their maxima, sums and code
// sums each come out of one reduce16 tree as one vector (lane i: half group
// i), where a horizontal reduction per half group costs about 3x the
// instructions. The conversion rounds to nearest even, as nearbyint does.
inline void quantize_row_v16(QuantizedRows& qr, const float* x, int64_t r, int64_t groups, float centre) {
  using namespace kvserve;
  const int64_t halves = 2 * groups;
  for (int64_t h0 = 0; h0 < halves; h0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, halves - h0));
    V16 v[16], a[16];
    for (int i = 0; i < 16; ++i) {
      v[i] = i < n ? v16_load(x + (h0 + i) * 16) : v16_zero();
      a[i] = v16_abs(v[i]);
    }
    const V16 amax = max16(a);
    alignas(64) float inv[16], d[16], sum[16], qsum[16];
    v16_store(inv, v16_div_where_positive(127.0f, amax));
    v16_store(d, v16_div(amax, v16_set1(127.0f)));
    v16_store(sum, sum16(v));
    V16 qf[16];
    for (int i = 0; i < 16; ++i) {
      if (i >= n) {
        qf[i] = v16_zero();
        continue;
      }
      const int64_t hg = h0 + i, gr = (hg / 2) * qr.rows + r;
      const V16i qv = v16_round_to_int(v[i] * v16_set1(inv[i]));
      v16i_store_int8(qr.q.data() + gr * kGroup + (hg % 2) * 16, qv);
      qf[i] = v16_from_int(qv);  // |sum| <= 16 * 127: exact in float
    }
    v16_store(qsum, sum16(qf));
    for (int i = 0; i < n; i += 2) {  // h0 and n are even: whole groups
      const int64_t gr = ((h0 + i) / 2) * qr.rows + r;
      qr.d[2 * gr] = d[i];
      qr.d[2 * gr + 1] = d[i + 1];
      qr.qs[2 * gr] = static_cast<int32_t>(qsum[i]);
      qr.qs[2 * gr + 1] = static_cast<int32_t>(qsum[i + 1]);
      const float s = sum[i] + sum[i + 1];
      qr.sum[gr] = s;
      qr.shift[gr] = centre * (s - (d[i] * qsum[i] + d[i + 1] * qsum[i + 1]));
    }
  }
}
#endif

// The same rounding on every path: dx = max|x| / 127, qx = nearest(x / dx), ties to even.
// Room for `stride_rows` >= rows rows per group; the ones past `rows` stay zero.
inline QuantizedRows quantize_rows(const float* x, int64_t rows, int64_t xs, int64_t groups, float centre,
                            int64_t stride_rows) {
  const int64_t n = stride_rows * groups;
  QuantizedRows qr{std::vector<int8_t>(n * kGroup), std::vector<float>(n * 2), std::vector<float>(n),
                   std::vector<float>(n), std::vector<int32_t>(n * 2), stride_rows};
  kvserve::parallel_chunks(rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
#if defined(KVSERVE_V16)
      quantize_row_v16(qr, x + r * xs, r, groups, centre);
#else
      quantize_row(qr, x + r * xs, r, groups, centre);
#endif
    }
  });
  return qr;
}

// Code u of row i (in its tile), input k (in its group), for the plain paths.
template <int kBits>
inline int code_at(const uint8_t* group, int i, int k) {
  if constexpr (kBits == 4) {
    const uint8_t byte = group[(k % 16) / 4 * 64 + i * 4 + k % 4];
    return k < 16 ? byte & 0xF : byte >> 4;
  } else {
    return group[k / 4 * 64 + i * 4 + k % 4];
  }
}

#if defined(KVSERVE_V16)
using kvserve::V16;
using kvserve::V16i;

// The group's codes as bytes, inputs 0..15 in w[0..3] and 16..31 in w[4..7],
// 4 inputs per 32-bit lane.
template <int kBits>
KVSERVE_ALWAYS_INLINE void load_codes(const uint8_t* group, V16i* w) {
  using namespace kvserve;
  if constexpr (kBits == 4) {
    const V16i low4 = v16i_set1(0x0F0F0F0F);
    for (int j = 0; j < 4; ++j) {
      const V16i packed = v16i_load(group + j * 64);
      w[j] = packed & low4;
      w[4 + j] = v16i_srli16(packed, 4) & low4;
    }
  } else {
    for (int j = 0; j < 8; ++j) w[j] = v16i_load(group + j * 64);
  }
}
#endif

#if defined(KVSERVE_V16)
// Calls f(std::integral_constant<int, rows>{}) for 1 <= rows <= R, so the
// tile functions get their row count (and register arrays) at compile time.
template <int R, typename F>
inline void with_rows(int rows, F&& f) {
  if constexpr (R > 0) {
    if (rows == R) return f(std::integral_constant<int, R>{});
    return with_rows<R - 1>(rows, f);
  }
}
#endif

#if defined(KVSERVE_V16_INT8)
// s0, s1 = the integer dots of each tile row's codes with the two halves of
// one row's group of int8 x (inputs 0-15 and 16-31). Exact on every path, so
// VNNI, AVX512-BW and AVX2 give the same sums (and AMX too). kVnni: the pass
// has kVnniRows rows or more, so vpdpbusd runs them where the build has it.
template <int kBits, bool kVnni>
KVSERVE_ALWAYS_INLINE void group_dots(V16i& s0, V16i& s1, const V16i* w, const int8_t* qx) {
  using namespace kvserve;
#if defined(KVSERVE_V16_VNNI)
  if constexpr (kVnni) {
    s0 = v16i_zero();
    s1 = v16i_zero();
    for (int j = 0; j < 4; ++j) {
      v16i_dpbusd_bcast4(s0, w[j], qx + 4 * j);
      v16i_dpbusd_bcast4(s1, w[4 + j], qx + 16 + 4 * j);
    }
    return;
  }
#endif
#if defined(KVSERVE_V16_VNNI) && defined(KVSERVE_V16_AVX512)
  static_assert(kVnni, "AVX512-VNNI runs the dots at every row count (kVnniRows)");
#else
  // Without VNNI: pairs of byte products summed to int16 (vpmaddubsw), then
  // added in int16 while no sum can pass 32767 before widening (vpmaddwd): a
  // pair of codes of kBits bits against |qx| <= 127 is at most 2 (2^kBits - 1) 127,
  // so four such sums stay within range for 4- and 5-bit codes (15240, 31496), two for
  // 6-bit ones (32004); nothing saturates, and the dots are VNNI's exactly. Codes of
  // 7 or 8 bits go as their two nibbles.
  // Forced inline as the helpers around it (vec16.h): out of line, GCC passed u through memory.
  const auto dots = [](const V16i* u, const int8_t* x) __attribute__((always_inline)) {
    if constexpr (kBits == 6) {
      const V16i p01 = v16i_add16(v16i_maddubs(u[0], v16i_bcast4(x)), v16i_maddubs(u[1], v16i_bcast4(x + 4)));
      const V16i p23 = v16i_add16(v16i_maddubs(u[2], v16i_bcast4(x + 8)), v16i_maddubs(u[3], v16i_bcast4(x + 12)));
      return v16i_add(v16i_widen_pairs(p01), v16i_widen_pairs(p23));
    }
    V16i p = v16i_maddubs(u[0], v16i_bcast4(x));
    for (int j = 1; j < 4; ++j) p = v16i_add16(p, v16i_maddubs(u[j], v16i_bcast4(x + 4 * j)));
    return v16i_widen_pairs(p);
  };
  if constexpr (kBits <= 6) {
    s0 = dots(w, qx);
    s1 = dots(w + 4, qx + 16);
  } else {  // u = lo + 16 hi
    const V16i low4 = v16i_set1(0x0F0F0F0F);
    V16i lo[8], hi[8];
    for (int j = 0; j < 8; ++j) {
      lo[j] = w[j] & low4;
      hi[j] = v16i_srli16(w[j], 4) & low4;
    }
    s0 = v16i_add(dots(lo, qx), v16i_slli32(dots(hi, qx), 4));
    s1 = v16i_add(dots(lo + 4, qx + 16), v16i_slli32(dots(hi + 4, qx + 16), 4));
  }
#endif
}

// Rows per pass from which the dots run on vpdpbusd: every pass on AVX-512;
// in the AVX2 build (AVX-VNNI) from 8 rows, as below, the chain of four
// dependent vpdpbusd per half group waits on their latency and the
// multiply-adds were faster (SmolLM2's four projections, w4a8, 2 threads:
// 1 / 4 / 16 / 64 rows 80-103 / 200-233 / 326-476 / 1217-1427 us against
// 65-72 / 157-178 / 539-623 / 2153-2473 us; measured on Zen 4, whose
// AVX512-VNNI runs the same instruction on 256 bits, as no AVX-VNNI CPU was at
// hand). Both give the same sums.
#if defined(KVSERVE_V16_AVX512)
constexpr int kVnniRows = 1;
#else
constexpr int kVnniRows = 8;
#endif
#endif  // KVSERVE_V16_INT8

// Rows of x a thread takes through a run of tiles before the next rows. The
// rows' int8 codes (48 x K bytes: 27 KB for K = 576) then stay in L1 across
// tiles instead of streaming from L2 once per tile. Measured on the default
// model's four projection shapes (2 threads): 512 rows 12-20% faster, 64-256
// rows unchanged.
constexpr int64_t kRowBlock = 48;

// Tiles a thread claims at a time (parallel_chunks): few enough claims to
// cost nothing, small enough pieces for an idle thread to take over.
constexpr int64_t kTileGrain = 4;

// f(tile, first_row, rows, valid_outputs) for every 16-row tile of W and every
// chunk of up to `chunk` rows of x, tiles spread over torch's threads.
//  * Up to 2 row blocks (decode batches): a claim is kTileGrain tiles over all
//    rows, row blocks outer.
//  * More (prompt chunks): a claim is kTileGrain tiles over one row block,
//    tile-major, so a thread's share is still a run of tiles over all rows,
//    but the last claims stay small. With 4 tiles x 512 rows per claim, a
//    thread finishing early waited for up to a ninth of o_proj (36 tiles); a
//    step of 4 x 128-token prompts (or 64 decodes + 3 x 128 prompt tokens) ran
//    about 5-10% faster this way (one process, builds alternating).
template <typename F>
void for_each_tile_chunk(int64_t rows, int64_t chunk, int64_t tiles, int64_t n, F&& f) {
  const auto run = [&](int64_t t0, int64_t t1, int64_t r0, int64_t r1) {
    for (int64_t rb = r0; rb < r1; rb += kRowBlock) {
      const int64_t rend = std::min(r1, rb + kRowBlock);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t valid = std::min(kTile, n - t * kTile);
        for (int64_t r = rb; r < rend; r += chunk) f(t, r, static_cast<int>(std::min(chunk, rend - r)), valid);
      }
    }
  };
  const int64_t row_blocks = (rows + kRowBlock - 1) / kRowBlock;
  if (row_blocks <= 2) {
    kvserve::parallel_chunks(tiles, kTileGrain, [&](int64_t begin, int64_t end) { run(begin, end, 0, rows); });
    return;
  }
  const int64_t tile_chunks = (tiles + kTileGrain - 1) / kTileGrain;
  kvserve::parallel_chunks(tile_chunks * row_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t0 = (item / row_blocks) * kTileGrain, rb = (item % row_blocks) * kRowBlock;
      run(t0, std::min(tiles, t0 + kTileGrain), rb, std::min(rows, rb + kRowBlock));
    }
  });
}

}  // namespace kvserve::grouped

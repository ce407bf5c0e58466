// y = x @ W^T with W in groups of 32 inputs per row, each weight an unsigned
// code u times a scale plus an offset: w = d * u + m, one float d and m per
// group. Two code widths:
//   4 bits (GGUF Q4_1's scheme: u in 0..15, m the group minimum);
//   8 bits (GGUF Q8_0's w = d * q, q in -127..127, stored as u = q + 128 with m = -128 d).
//
// Two kinds of arithmetic on the same packed weights:
//  * float activations: a 16-row weight tile is turned into float vectors and
//    reused for several rows of x. Per group, sum_k x_k (d u_k + m) =
//    d * sum_k x_k u_k + m * sum_k x_k, so the scales apply once per group.
//    The result equals the dequantised float matmul up to summation order.
//  * int8 activations (as llama.cpp's Q8 x Q4 dot products): each row of x is
//    rounded per 16 inputs (x ~ dx * qx, qx in -127..127) and the integer dot
//    products run on AVX512-VNNI's vpdpbusd, 64 multiply-adds per instruction
//    where a float FMA does 16. This adds one rounding of x to 8 bits.
//
// Packed layout, for 16-row tile t and group g, made so that the 32-bit lane
// i of a 64-byte vector holds 4 consecutive inputs of weight row 16t + i (the
// operand shape of vpdpbusd):
//   4 bits: codes[t][g][j][i][b] = u[16t+i][32g+4j+b] | u[16t+i][32g+16+4j+b] << 4   (j < 4)
//   8 bits: codes[t][g][j][i][b] = u[16t+i][32g+4j+b]                                (j < 8)
//   scales[t][g][0][i] = d, scales[t][g][1][i] = m
// Rows are padded to a multiple of 16 with zeros.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include "grouped_gemm.h"
#include "grouped_gemm_amx.h"
#include "parallel.h"
#include "vec16.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace {

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
// shift [groups][rows] = c * (sum(x) - dx0 sum(qx_lo) - dx1 sum(qx_hi)) (see tile_rows_a8).
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> d, sum, shift;
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
      const float s = sum[i] + sum[i + 1];
      qr.sum[gr] = s;
      qr.shift[gr] = centre * (s - (d[i] * qsum[i] + d[i + 1] * qsum[i + 1]));
    }
  }
}
#endif

// The same rounding on every path: dx = max|x| / 127, qx = nearest(x / dx), ties to even.
// Room for `stride_rows` >= rows rows per group; the ones past `rows` stay zero.
QuantizedRows quantize_rows(const float* x, int64_t rows, int64_t xs, int64_t groups, float centre,
                            int64_t stride_rows) {
  const int64_t n = stride_rows * groups;
  QuantizedRows qr{std::vector<int8_t>(n * kGroup), std::vector<float>(n * 2), std::vector<float>(n),
                   std::vector<float>(n), stride_rows};
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

// Up to R rows of float x against one 16-row tile. Byte b of each lane of
// w[j] holds input 4j + b (j < 4) or 16 + 4(j - 4) + b.
template <int kBits, int R>
KVSERVE_ALWAYS_INLINE void tile_rows(float* y, int64_t y_stride, const float* x, int64_t x_stride,
                                     const float* xsum, int64_t groups, const uint8_t* codes,
                                     const float* scales, int64_t valid) {
  using namespace kvserve;
  constexpr int64_t kGroupBytes = kTile * kGroup * kBits / 8;  // one group of a 16-row tile
  V16 acc[R], accq[R];
  for (int r = 0; r < R; ++r) acc[r] = v16_zero();
  const V16i byte = v16i_set1(0xFF);
  for (int64_t g = 0; g < groups; ++g) {
    V16i w[8];
    load_codes<kBits>(codes + g * kGroupBytes, w);
    const float* xg = x + g * kGroup;
    for (int r = 0; r < R; ++r) accq[r] = v16_zero();
    for (int j = 0; j < 8; ++j) {
      const int k0 = j < 4 ? 4 * j : 16 + 4 * (j - 4);
      for (int b = 0; b < 4; ++b) {
        const V16 u = v16_from_int(v16i_srli32(w[j], 8 * b) & byte);
        for (int r = 0; r < R; ++r) accq[r] = v16_fmadd(v16_set1(xg[r * x_stride + k0 + b]), u, accq[r]);
      }
    }
    const V16 d = v16_load(scales + g * 32);
    const V16 m = v16_load(scales + g * 32 + 16);
    for (int r = 0; r < R; ++r) {
      acc[r] = v16_fmadd(d, accq[r], acc[r]);
      acc[r] = v16_fmadd(m, v16_set1(xsum[r * groups + g]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) v16_store_n(y + r * y_stride, acc[r], static_cast<int>(valid));
}

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
  // Without VNNI: pairs of byte products summed to int16 (vpmaddubsw), four
  // such sums added in int16 before widening. With codes of at most 15 and
  // |qx| <= 127 a sum stays within 4 * 2 * 15 * 127 = 15240: nothing saturates,
  // and the dots are VNNI's exactly. 8-bit codes go as their two nibbles.
  // Forced inline as the helpers around it (vec16.h): out of line, GCC passed u through memory.
  const auto dots = [](const V16i* u, const int8_t* x) __attribute__((always_inline)) {
    V16i p = v16i_maddubs(u[0], v16i_bcast4(x));
    for (int j = 1; j < 4; ++j) p = v16i_add16(p, v16i_maddubs(u[j], v16i_bcast4(x + 4 * j)));
    return v16i_widen_pairs(p);
  };
  if constexpr (kBits == 4) {
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

// Up to R rows of int8 x against one 16-row tile. The codes u are the
// unsigned operand of the dots, x's codes the signed one; s0 and s1 are the
// dots of the two halves of the group, each half with its own dx. With
// centre c and w = d (u - c) + (m + c d), per group:
//   y += d * (dx0 s0 + dx1 s1 + shift) + m * sum(x),
//   shift = c (sum(x) - dx0 sum(qx_lo) - dx1 sum(qx_hi)),
// which is d * sum((u - c) dx qx) + (m + c d) sum(x): the rounding error of x
// meets the centred codes u - c (about half the size of u for 4 bits, and
// exactly Q8_0's q for 8 bits, where m + c d = 0).
template <int kBits, int R>
KVSERVE_ALWAYS_INLINE void tile_rows_a8(float* y, int64_t y_stride, const QuantizedRows& xq, int64_t r0,
                                        int64_t groups, const uint8_t* codes, const float* scales,
                                        int64_t valid) {
  using namespace kvserve;
  constexpr int64_t kGroupBytes = kTile * kGroup * kBits / 8;  // one group of a 16-row tile
  V16 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = v16_zero();
  for (int64_t g = 0; g < groups; ++g) {
    V16i w[8];
    load_codes<kBits>(codes + g * kGroupBytes, w);
    const V16 d = v16_load(scales + g * 32);
    const V16 m = v16_load(scales + g * 32 + 16);
    const int64_t first = g * xq.rows + r0;  // this chunk's rows of group g
    const int8_t* qx = xq.q.data() + first * kGroup;
    const float* dx = xq.d.data() + first * 2;
    const float* shift = xq.shift.data() + first;
    const float* sum = xq.sum.data() + first;
#pragma GCC unroll 16  // keep acc[] in registers (GCC left this loop rolled, acc[] on the stack)
    for (int r = 0; r < R; ++r) {
      V16i s0, s1;
      group_dots<kBits, (R >= kVnniRows)>(s0, s1, w, qx + r * kGroup);
      V16 t = v16_fmadd(v16_from_int(s1), v16_set1(dx[2 * r + 1]), v16_set1(shift[r]));
      t = v16_fmadd(v16_from_int(s0), v16_set1(dx[2 * r]), t);
      acc[r] = v16_fmadd(d, t, acc[r]);
      acc[r] = v16_fmadd(m, v16_set1(sum[r]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) v16_store_n(y + r * y_stride, acc[r], static_cast<int>(valid));
}
#endif

// Plain C++ for CPUs without AVX2 (or without its integer dots): the same
// arithmetic, one output at a time. The tests run them on every machine (`plain=true`).
// float activations: y = sum_g (d sum_k x u + m sum_k x)
template <int kBits>
void tile_rows_plain(int rows, float* y, int64_t ys, const float* x, int64_t xs, int64_t groups,
                     const uint8_t* codes, const float* scales, int64_t valid) {
  constexpr int64_t kGroupBytes = kTile * kGroup * kBits / 8;  // one group of a 16-row tile
  for (int r = 0; r < rows; ++r) {
    for (int i = 0; i < valid; ++i) {
      float acc = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        float dot = 0.0f, sum = 0.0f;
        for (int k = 0; k < kGroup; ++k) {
          const float xv = x[r * xs + g * kGroup + k];
          dot += xv * static_cast<float>(code_at<kBits>(codes + g * kGroupBytes, i, k));
          sum += xv;
        }
        acc += scales[g * 32 + i] * dot + scales[g * 32 + 16 + i] * sum;
      }
      y[r * ys + i] = acc;
    }
  }
}

// int8 activations: y = sum_g (d sum_h dx_h sum_k (u - c) qx + (m + c d) sum_k x), integer dots.
template <int kBits>
void tile_rows_a8_plain(int rows, float* y, int64_t ys, const QuantizedRows& xq, int64_t r0, int64_t groups,
                        const uint8_t* codes, const float* scales, int64_t valid) {
  constexpr int64_t kGroupBytes = kTile * kGroup * kBits / 8;  // one group of a 16-row tile
  constexpr int kCentre = 1 << (kBits - 1);
  for (int r = 0; r < rows; ++r) {
    for (int i = 0; i < valid; ++i) {
      float acc = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t gr = g * xq.rows + r0 + r;
        float t = 0.0f;
        for (int h = 0; h < 2; ++h) {
          int32_t dot = 0;
          for (int k = 16 * h; k < 16 * h + 16; ++k) {
            dot += (code_at<kBits>(codes + g * kGroupBytes, i, k) - kCentre) * xq.q[gr * kGroup + k];
          }
          t += static_cast<float>(dot) * xq.d[2 * gr + h];
        }
        const float d = scales[g * 32 + i], m = scales[g * 32 + 16 + i];
        acc += d * t + (m + kCentre * d) * xq.sum[gr];
      }
      y[r * ys + i] = acc;
    }
  }
}

// Rows of x a thread takes through a run of tiles before the next rows. The
// rows' int8 codes (48 x K bytes: 27 KB for K = 576) then stay in L1 across
// tiles instead of streaming from L2 once per tile. Measured on the default
// model's four projection shapes (2 threads): 512 rows 12-20% faster, 64-256
// rows unchanged.
constexpr int64_t kRowBlock = 48;

// From this many rows the int8-activation GEMM runs on AMX where the CPU has it
// (grouped_gemm_amx.cpp): below, VNNI's registers beat the tiles' round trip
// through memory.
constexpr int64_t kAmxMinRows = 16;

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

template <int kBits>
void grouped_linear_impl(at::Tensor& out, const at::Tensor& x, const uint8_t* cp, const float* sp, int64_t tiles,
                         int64_t groups, bool int8_acts, bool plain) {
  constexpr int64_t kGroupBytes = kTile * kGroup * kBits / 8;  // one group of a 16-row tile
  const int64_t rows = x.size(0);
  const float* xp = x.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  const int64_t xs = x.stride(0), ys = out.stride(0);
#if !defined(KVSERVE_V16)
  plain = true;
#endif
#if !defined(KVSERVE_V16_INT8)
  plain = plain || int8_acts;
#endif
  const float centre = static_cast<float>(1 << (kBits - 1));
  if (int8_acts && !plain && rows >= kAmxMinRows && kvserve::amx_enabled()) {
    const int64_t padded = (rows + 15) / 16 * 16;
    const QuantizedRows xq = quantize_rows(xp, rows, xs, groups, centre, padded);
    const kvserve::AmxRows ax{xq.q.data(), xq.d.data(), xq.shift.data(), xq.sum.data(), rows, padded};
    kvserve::grouped_linear_a8_amx(kBits, yp, ys, ax, cp, sp, tiles, groups, out.size(1));
    return;
  }
  QuantizedRows xq;
  if (int8_acts) xq = quantize_rows(xp, rows, xs, groups, centre, rows);
  std::vector<float> xsum;  // the float path's per-group input sums (the m term)
  if (!int8_acts && !plain) {
    xsum.resize(rows * groups);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t g = 0; g < groups; ++g) {
        float acc = 0.0f;
        for (int64_t i = 0; i < kGroup; ++i) acc += xp[r * xs + g * kGroup + i];
        xsum[r * groups + g] = acc;
      }
    }
  }
  const int64_t chunk = int8_acts ? kRowsInt8 : kRowsFloat;
  for_each_tile_chunk(rows, chunk, tiles, out.size(1), [&](int64_t t, int64_t r0, int r, int64_t valid) {
    float* y = yp + r0 * ys + t * kTile;
    const uint8_t* c = cp + t * groups * kGroupBytes;
    const float* s = sp + t * groups * 32;
    if (plain) {
      if (int8_acts) tile_rows_a8_plain<kBits>(r, y, ys, xq, r0, groups, c, s, valid);
      else tile_rows_plain<kBits>(r, y, ys, xp + r0 * xs, xs, groups, c, s, valid);
      return;
    }
#if defined(KVSERVE_V16)
#if defined(KVSERVE_V16_INT8)
    if (int8_acts) {
      return with_rows<kRowsInt8>(r, [&](auto n) {
        tile_rows_a8<kBits, decltype(n)::value>(y, ys, xq, r0, groups, c, s, valid);
      });
    }
#endif
    with_rows<kRowsFloat>(r, [&](auto n) {
      tile_rows<kBits, decltype(n)::value>(y, ys, xp + r0 * xs, xs, xsum.data() + r0 * groups, groups, c, s, valid);
    });
#endif
  });
}

}  // namespace

// x [M, K] float32 (rows contiguous), codes [N/16, K/32, 4 or 8, 64] uint8
// (4 or 8 bits), scales [N/16, K/32, 2, 16] float32 -> out [M, N] float32.
// int8_activations: the integer-dot arithmetic above; plain: the portable C++.
void grouped_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                    bool int8_activations, bool plain) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat, "x must be float32 [M, K]");
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.scalar_type() == at::kFloat, "out must be float32 [M, N]");
  TORCH_CHECK(codes.is_contiguous() && codes.scalar_type() == at::kByte && codes.dim() == 4 &&
                  (codes.size(2) == 4 || codes.size(2) == 8) && codes.size(3) == 64,
              "codes must be contiguous uint8 [N/16, K/32, 4 or 8, 64]");
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kFloat && scales.dim() == 4 &&
                  scales.size(0) == codes.size(0) && scales.size(1) == codes.size(1) && scales.size(2) == 2 &&
                  scales.size(3) == kTile,
              "scales must be contiguous float32 [N/16, K/32, 2, 16]");
  const int64_t n = out.size(1), tiles = codes.size(0), groups = codes.size(1);
  TORCH_CHECK(x.size(1) == groups * kGroup && out.size(0) == x.size(0), "x and out do not match the packed weight");
  TORCH_CHECK(tiles * kTile >= n && (tiles - 1) * kTile < n, "out width does not match the packed weight");
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  if (codes.size(2) == 4) grouped_linear_impl<4>(out, x, cp, sp, tiles, groups, int8_activations, plain);
  else grouped_linear_impl<8>(out, x, cp, sp, tiles, groups, int8_activations, plain);
}

// What the int8-activation path's integer dots run on: "avx512-vnni" or
// "avx-vnni" (vpdpbusd on 512 or 256 bits), "avx512-bw" or "avx2" (vpmaddubsw +
// vpmaddwd), or "" (the plain C++).
std::string int8_dots() {
#if defined(KVSERVE_V16_VNNI) && defined(KVSERVE_V16_AVX512)
  return "avx512-vnni";
#elif defined(KVSERVE_V16_VNNI)
  return "avx-vnni";
#elif defined(KVSERVE_V16_INT8) && defined(KVSERVE_V16_AVX512)
  return "avx512-bw";
#elif defined(KVSERVE_V16_INT8)
  return "avx2";
#else
  return "";
#endif
}

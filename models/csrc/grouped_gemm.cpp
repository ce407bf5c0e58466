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
#include "grouped_rows.h"
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

using namespace kvserve::grouped;

#if defined(KVSERVE_V16)
using kvserve::V16;
using kvserve::V16i;


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
#endif

#if defined(KVSERVE_V16_INT8)

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

// From this many rows the int8-activation GEMM runs on AMX where the CPU has it
// (grouped_gemm_amx.cpp): below, VNNI's registers beat the tiles' round trip
// through memory.
constexpr int64_t kAmxMinRows = 16;

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

// y = x @ W^T with W in 4-bit (or 8-bit, at the end) groups of 32 (GGUF Q4_1's scheme: w = d * q + m,
// q in 0..15, one float d and m per 32 inputs of a row), float32 activations.
//
// torch's own int4 CPU kernel takes bfloat16 activations and reads the weights
// once per row of x, so its cost grows with every sequence of a decode batch.
// This one dequantises a tile of 16 output rows x 2 inputs into two vectors and
// reuses them for up to kRows rows of x, so a batch of 16 costs little more
// than a batch of 1 in weight traffic. Scales stay float32: the result equals
// the dequantised float matmul up to summation order.
//
// Packed layout, for 16-row tile t, group g (32 inputs), input pair p:
//   codes[t][g][p][i] = q[16t + i][32g + 2p] | q[16t + i][32g + 2p + 1] << 4
//   scales[t][g][0][i] = d, scales[t][g][1][i] = m   (rows padded to 16 with 0)
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kTile = 16;   // output rows per vector
constexpr int64_t kGroup = 32;  // inputs per scale
constexpr int kRows = 8;        // rows of x per pass over a tile

#if defined(__AVX512F__)
// Up to R rows of x against one 16-row tile. Per group, sum_k x_k (d q_k + m)
// = d * sum_k x_k q_k + m * sum_k x_k: the codes go through the FMAs as they
// are and the scales are applied once per group (xsum holds sum_k x_k).
template <int R>
inline void tile_rows(float* y, int64_t y_stride, const float* x, int64_t x_stride, const float* xsum,
                      int64_t groups, const uint8_t* codes, const float* scales, int64_t valid) {
  __m512 acc[R], accq[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi32(0xF);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* c = codes + g * 256;
    const float* xg = x + g * kGroup;
    for (int r = 0; r < R; ++r) accq[r] = _mm512_setzero_ps();
    for (int p = 0; p < 16; ++p) {
      const __m512i pair = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + p * 16)));
      const __m512 q0 = _mm512_cvtepi32_ps(_mm512_and_si512(pair, low4));
      const __m512 q1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(pair, 4));
      for (int r = 0; r < R; ++r) {
        accq[r] = _mm512_fmadd_ps(_mm512_set1_ps(xg[r * x_stride + 2 * p]), q0, accq[r]);
        accq[r] = _mm512_fmadd_ps(_mm512_set1_ps(xg[r * x_stride + 2 * p + 1]), q1, accq[r]);
      }
    }
    const __m512 d = _mm512_loadu_ps(scales + g * 32);
    const __m512 m = _mm512_loadu_ps(scales + g * 32 + 16);
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(d, accq[r], acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xsum[r * groups + g]), acc[r]);
    }
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * y_stride, mask, acc[r]);
}

// The int8 twin (GGUF Q8_0's scheme: w = d * q, q in -127..127): codes are one
// byte per input, [group][32 inputs][16 rows].
template <int R>
inline void tile_rows_i8(float* y, int64_t y_stride, const float* x, int64_t x_stride, int64_t groups,
                         const int8_t* codes, const float* scales, int64_t valid) {
  __m512 acc[R], accq[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int8_t* c = codes + g * 512;
    const float* xg = x + g * kGroup;
    for (int r = 0; r < R; ++r) accq[r] = _mm512_setzero_ps();
    for (int i = 0; i < 32; ++i) {
      const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + i * 16))));
      for (int r = 0; r < R; ++r) accq[r] = _mm512_fmadd_ps(_mm512_set1_ps(xg[r * x_stride + i]), q, accq[r]);
    }
    const __m512 d = _mm512_loadu_ps(scales + g * 16);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(d, accq[r], acc[r]);
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * y_stride, mask, acc[r]);
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

// Plain C++ for CPUs without AVX-512: same arithmetic, one output at a time.
// (Compiled everywhere, so a change that breaks them fails the build here too.)
[[maybe_unused]] void tile_rows_i8_scalar(int rows, float* y, int64_t ys, const float* x, int64_t xs, int64_t groups,
                         const int8_t* codes, const float* scales, int64_t valid) {
  for (int r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < valid; ++i) {
      float acc = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        float accq = 0.0f;
        for (int k = 0; k < 32; ++k) accq += x[r * xs + g * kGroup + k] * static_cast<float>(codes[g * 512 + k * 16 + i]);
        acc += scales[g * 16 + i] * accq;
      }
      y[r * ys + i] = acc;
    }
  }
}

[[maybe_unused]] void tile_rows_scalar(int rows, float* y, int64_t ys, const float* x, int64_t xs, const uint8_t* codes,
                      const float* scales, int64_t groups, int64_t valid) {
  for (int r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < valid; ++i) {
      float acc = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        const float d = scales[g * 32 + i], m = scales[g * 32 + 16 + i];
        for (int p = 0; p < 16; ++p) {
          const uint8_t b = codes[g * 256 + p * 16 + i];
          acc += x[r * xs + g * kGroup + 2 * p] * (d * static_cast<float>(b & 0xF) + m);
          acc += x[r * xs + g * kGroup + 2 * p + 1] * (d * static_cast<float>(b >> 4) + m);
        }
      }
      y[r * ys + i] = acc;
    }
  }
}

// Checks shared by both kernels; the code and scale layouts are each kernel's own.
void check_grouped(const at::Tensor& out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                   at::ScalarType code_type, int64_t scale_dims) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat, "x must be float32 [M, K]");
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.scalar_type() == at::kFloat, "out must be float32 [M, N]");
  TORCH_CHECK(codes.is_contiguous() && codes.scalar_type() == code_type && codes.dim() == 4,
              "codes must be contiguous ", code_type, " [N/16, K/32, ., 16]");
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kFloat && scales.dim() == scale_dims,
              "scales must be contiguous float32 with ", scale_dims, " dims");
  const int64_t n = out.size(1), tiles = codes.size(0);
  TORCH_CHECK(x.size(1) == codes.size(1) * kGroup && out.size(0) == x.size(0),
              "x and out do not match the packed weight");
  TORCH_CHECK(tiles * kTile >= n && (tiles - 1) * kTile < n, "out width does not match the packed weight");
}

// f(tile, first_row, rows, valid_outputs) for every 16-row tile of W and every
// chunk of up to kRows rows of x, tiles spread over torch's threads.
template <typename F>
void for_each_tile_chunk(int64_t rows, int64_t tiles, int64_t n, F&& f) {
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t valid = std::min(kTile, n - t * kTile);
      for (int64_t r0 = 0; r0 < rows; r0 += kRows) f(t, r0, static_cast<int>(std::min<int64_t>(kRows, rows - r0)), valid);
    }
  });
}

}  // namespace

// x [M, K] float32 (rows contiguous), codes [N/16, K/32, 16, 16] uint8,
// scales [N/16, K/32, 2, 16] float32 -> out [M, N] float32.
void int4_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  check_grouped(out, x, codes, scales, at::kByte, 4);
  const int64_t rows = x.size(0), groups = codes.size(1);
  const float* xp = x.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const int64_t xs = x.stride(0), ys = out.stride(0);
#if defined(__AVX512F__)
  // Each row's per-group input sums, shared by every tile.
  std::vector<float> xsum(rows * groups);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      float acc = 0.0f;
      for (int64_t i = 0; i < kGroup; ++i) acc += xp[r * xs + g * kGroup + i];
      xsum[r * groups + g] = acc;
    }
  }
#endif
  for_each_tile_chunk(rows, codes.size(0), out.size(1), [&](int64_t t, int64_t r0, int r, int64_t valid) {
    float* y = yp + r0 * ys + t * kTile;
    const float* xr = xp + r0 * xs;
    const uint8_t* c = cp + t * groups * 256;
    const float* s = sp + t * groups * 32;
#if defined(__AVX512F__)
    with_rows<kRows>(r, [&](auto n) {
      tile_rows<decltype(n)::value>(y, ys, xr, xs, xsum.data() + r0 * groups, groups, c, s, valid);
    });
#else
    tile_rows_scalar(r, y, ys, xr, xs, c, s, groups, valid);
#endif
  });
}

// x [M, K] float32, codes [N/16, K/32, 32, 16] int8, scales [N/16, K/32, 16] float32 -> out [M, N].
void int8_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  check_grouped(out, x, codes, scales, at::kChar, 3);
  const int64_t groups = codes.size(1);
  const float* xp = x.data_ptr<float>();
  float* yp = out.data_ptr<float>();
  const int8_t* cp = codes.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  const int64_t xs = x.stride(0), ys = out.stride(0);
  for_each_tile_chunk(x.size(0), codes.size(0), out.size(1), [&](int64_t t, int64_t r0, int r, int64_t valid) {
    float* y = yp + r0 * ys + t * kTile;
    const float* xr = xp + r0 * xs;
    const int8_t* c = cp + t * groups * 512;
    const float* s = sp + t * groups * 16;
#if defined(__AVX512F__)
    with_rows<kRows>(r, [&](auto n) { tile_rows_i8<decltype(n)::value>(y, ys, xr, xs, groups, c, s, valid); });
#else
    tile_rows_i8_scalar(r, y, ys, xr, xs, groups, c, s, valid);
#endif
  });
}

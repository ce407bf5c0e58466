// Row-wise kernels: RMSNorm (with the residual add), SiLU * up, and RoPE with
// the KV-cache write (kernels.h declares them).
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>

#include "cache_rows.h"
#include "fastmath.h"
#include "kernels.h"
#include "parallel.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace kvserve {
namespace {

// Rows per parallel chunk for row-wise kernels: below this a step runs on one
// thread, since waking the pool costs more than a few small rows.
constexpr int64_t kRowGrain = 16;

// 1/x for x in [1, 2^125] without a divide (vector divides are very slow on
// some CPUs): a bit-trick first guess within 12%, then three Newton steps,
// each squaring the relative error; worst case 1.2e-7.
inline float recip_approx(float x) {
  float y = __builtin_bit_cast(float, 0x7EF311C7 - __builtin_bit_cast(int32_t, x));
  y = y * (2.0f - x * y);
  y = y * (2.0f - x * y);
  return y * (2.0f - x * y);
}

// sum(x[i]^2) in one fixed order: 16 lanes over the row, one tree across the
// lanes (vec16.h), then the tail in order. An `omp simd` reduction's order
// follows the vector width the compiler picks (and may follow alignment), so
// the AVX2 and AVX-512 builds summed differently.
template <typename T>
inline float sum_of_squares(const T* x, int64_t n) {
  float ss = 0.0f;
  int64_t i = 0;
#if defined(KVSERVE_V16)
  if constexpr (!std::is_same_v<T, double>) {  // load16 reads float32, float16 and bfloat16 rows
    if (n >= 16) {
      V16 acc = v16_zero();
      for (; i + 16 <= n; i += 16) {
        const V16 v = load16(x + i);
        acc = v16_fmadd(v, v, acc);
      }
      ss = v16_reduce_add(acc);
    }
  }
#endif
  for (; i < n; ++i) ss = std::fma(to_f(x[i]), to_f(x[i]), ss);
  return ss;
}

template <typename T>
void rms_norm_rows(T* out, const T* x, const T* w, int64_t hidden, double eps) {
  const float ss = sum_of_squares(x, hidden);
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(hidden) + static_cast<float>(eps));
  // As the reference: normalise, round to the storage dtype (a no-op for float), then scale.
#pragma omp simd
  for (int64_t i = 0; i < hidden; ++i) out[i] = static_cast<T>(to_f(w[i]) * to_f(static_cast<T>(to_f(x[i]) * r)));
}

template <typename T>
void add_rows(T* row, const T* add, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) row[i] = static_cast<T>(to_f(row[i]) + to_f(add[i]));
}

template <typename T>
void silu_mul_row(T* o, const T* g, const T* u, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float a = to_f(g[i]);
    // silu rounds to the storage dtype before the product, as eager torch does.
    // Past -80 silu is below 1e-33; the clamp keeps 1 + exp(-a) in recip_approx's range.
    const float s = to_f(static_cast<T>(a * recip_approx(1.0f + exp_approx(std::min(-a, 80.0f)))));
    o[i] = static_cast<T>(s * to_f(u[i]));
  }
}

// Rotate one head's interleaved pairs (x0, x1), (x2, x3), ... by (cos, sin) pairs.
template <typename T>
void rotate_head(T* x, const float* cs, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x0 = to_f(x[2 * i]), x1 = to_f(x[2 * i + 1]);
    const float c = cs[2 * i], s = cs[2 * i + 1];
    x[2 * i] = static_cast<T>(x0 * c - x1 * s);
    x[2 * i + 1] = static_cast<T>(x0 * s + x1 * c);
  }
}

// One head's values into a cache row: a cast, or int8 codes rounded to
// nearest (ties to even) at scale max|x| / 127, as kv_cache.to_cache_rows.
template <typename C, typename T>
inline void store_row(C* dst, const T* src, int64_t n) {
  if constexpr (std::is_same_v<C, T>) {
    std::memcpy(dst, src, n * sizeof(T));
  } else if constexpr (std::is_same_v<C, int8_t>) {
    float amax = 0.0f;
    for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(to_f(src[i])));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<int8_t>(std::nearbyint(to_f(src[i]) * inv));
    const float scale = amax / 127.0f;
    std::memcpy(dst + n, &scale, sizeof(float));
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<C>(to_f(src[i]));
  }
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with contiguous rows");
}

}  // namespace

// out = rms_norm(x) * weight, row by row.
void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(out, "out");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "weight must match the hidden size");
  const int64_t rows = x.size(0), hidden = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t xs = x.stride(0), os = out.stride(0);
    kvserve::parallel_chunks(rows, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) rms_norm_rows(op + r * os, xp + r * xs, wp, hidden, eps);
    });
  });
}

// x [rows, pieces, n] (n-value pieces contiguous, any strides between them) normalised in place,
// piece by piece, as rms_norm normalises a row of n: a layer's q/k norms on its qkv projection's
// output without copying the query and key parts out and back.
void rms_norm_pieces(at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x must be [rows, pieces, n] with contiguous pieces");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(2), "weight must match the pieces' size");
  const int64_t rows = x.size(0), pieces = x.size(1), n = x.size(2);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm_pieces", [&] {
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* xp = x.data_ptr<scalar_t>();
    const int64_t rs = x.stride(0), ps = x.stride(1);
    kvserve::parallel_chunks(rows, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        for (int64_t p = 0; p < pieces; ++p) rms_norm_rows(xp + r * rs + p * ps, xp + r * rs + p * ps, wp, n, eps);
    });
  });
}

// residual += x (rounded to the storage dtype), then out = rms_norm(residual) * weight.
void add_rms_norm(at::Tensor& out, at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight,
                  double eps) {
  check_rows(x, "x");
  check_rows(out, "out");
  check_rows(residual, "residual");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "weight must match the hidden size");
  const int64_t rows = x.size(0), hidden = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t xs = x.stride(0), rs = residual.stride(0), os = out.stride(0);
    kvserve::parallel_chunks(rows, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        add_rows(rp + r * rs, xp + r * xs, hidden);
        rms_norm_rows(op + r * os, rp + r * rs, wp, hidden, eps);
      }
    });
  });
}

// out[t, i] = silu(gate_up[t, i]) * gate_up[t, I + i] with I = out.size(1).
void silu_and_mul(at::Tensor& out, const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  check_rows(out, "out");
  const int64_t rows = out.size(0), inter = out.size(1);
  TORCH_CHECK(gate_up.size(0) == rows && gate_up.size(1) == 2 * inter, "gate_up must be [T, 2 * I]");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* gp = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t gs = gate_up.stride(0), os = out.stride(0);
    kvserve::parallel_chunks(rows, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* g = gp + r * gs;
        const scalar_t* u = g + inter;
        silu_mul_row(op + r * os, g, u, inter);
      }
    });
  });
}

// Rotate the Q and K heads of qkv [T, (H + 2 * KVH) * D] in place (interleaved
// pairs) by rotations [P, D / 2, 2] (cos, sin) at positions [T], then copy
// each token's K and V heads into slot slot_mapping[t] of the paged caches
// [num_blocks, block_size, KVH, D] (either packing of cache_strides).
void rotary_and_cache(at::Tensor& qkv, const at::Tensor& rotations, const at::Tensor& positions,
                      at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping,
                      int64_t num_heads, int64_t num_kv_heads) {
  check_rows(qkv, "qkv");
  const CacheStrides strides = cache_strides(k_cache, v_cache);
  TORCH_CHECK(rotations.is_contiguous() && rotations.scalar_type() == at::kFloat && rotations.dim() == 3,
              "rotations must be contiguous float32 [P, D/2, 2]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong,
              "positions and slot_mapping must be int64");
  const int64_t tokens = qkv.size(0);
  const int64_t half = rotations.size(1), head_dim = 2 * half;
  const int64_t max_pos = rotations.size(0);
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim, "qkv width does not match the heads");
  const int64_t row = cache_row(k_cache, head_dim);
  TORCH_CHECK(k_cache.size(2) == num_kv_heads && k_cache.size(3) == row, "cache shape does not match");
  TORCH_CHECK(positions.numel() == tokens && slot_mapping.numel() == tokens, "one position and slot per token");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V caches must share a dtype");
  const at::Tensor positions_c = positions.contiguous(), slots_c = slot_mapping.contiguous();
  const int64_t* pos = positions_c.data_ptr<int64_t>();
  const int64_t* slots = slots_c.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position ", pos[t], " out of range");
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " out of range");
  }
  const float* rot = rotations.data_ptr<float>();
  const int64_t kv_width = num_kv_heads * head_dim, block_size = k_cache.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rotary_and_cache", [&] {
    dispatch_cache_type(k_cache.scalar_type(), [&](auto cache_tag) {
      using C = decltype(cache_tag);
      scalar_t* base = qkv.data_ptr<scalar_t>();
      C* kc = static_cast<C*>(k_cache.data_ptr());
      C* vc = static_cast<C*>(v_cache.data_ptr());
      const int64_t stride = qkv.stride(0);
      kvserve::parallel_chunks(tokens, kRowGrain, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          scalar_t* token = base + t * stride;
          const float* cs = rot + pos[t] * half * 2;
          for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) rotate_head(token + h * head_dim, cs, half);
          const scalar_t* k = token + num_heads * head_dim;
          const int64_t at = slots[t] / block_size * strides.block + slots[t] % block_size * strides.token;
          for (int64_t h = 0; h < num_kv_heads; ++h) {
            store_row(kc + at + h * strides.head, k + h * head_dim, head_dim);
            store_row(vc + at + h * strides.head, k + kv_width + h * head_dim, head_dim);
          }
        }
      });
    });
  });
}

}  // namespace kvserve

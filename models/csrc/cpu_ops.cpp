// Fused CPU kernels for the decoder's small per-layer operations.
//
// Each kernel replaces a chain of eager torch ops (and their dispatch, which
// dominates a batch-1 decode step on a small model) with one pass over the
// data. Every kernel has a plain-torch twin in models/ops.py, and the tests
// compare the two. Arithmetic is float32 whatever the storage dtype, rounding
// to the storage dtype exactly where the eager torch code does.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "parallel.h"
#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// Rows per parallel chunk for row-wise kernels: below this a step runs on one
// thread, since waking the pool costs more than a few small rows.
constexpr int64_t kRowGrain = 16;

template <typename T>
inline float to_f(T v) { return static_cast<float>(v); }

// exp(x), written so the compiler vectorises it (std::exp is a scalar call):
// 2^(x log2 e) = 2^i * 2^f with i the nearest integer, f in [-0.5, 0.5), and
// 2^f by its degree-6 Taylor polynomial; relative error about 2e-7. Inputs
// are clamped to [-87, 88], where the result stays a normal float.
// kExp2Poly holds its coefficients, highest degree first (exp_approx16 is the
// same on 16 lanes).
constexpr float kExp2Poly[] = {0.0001540353f, 0.0013333558f, 0.0096181291f, 0.0555041087f,
                               0.2402265070f, 0.6931471806f, 1.0f};
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float t = x * 1.4426950408889634f;
  const float fi = std::floor(t + 0.5f);
  const float f = t - fi;
  float p = kExp2Poly[0];
  for (int i = 1; i < 7; ++i) p = p * f + kExp2Poly[i];
  const int32_t bits = (static_cast<int32_t>(fi) + 127) << 23;
  return p * __builtin_bit_cast(float, bits);
}

// 1/x for x in [1, 2^125] without a divide (vector divides are very slow on
// some CPUs): a bit-trick first guess within 12%, then three Newton steps,
// each squaring the relative error; worst case 1.2e-7.
inline float recip_approx(float x) {
  float y = __builtin_bit_cast(float, 0x7EF311C7 - __builtin_bit_cast(int32_t, x));
  y = y * (2.0f - x * y);
  y = y * (2.0f - x * y);
  return y * (2.0f - x * y);
}

template <typename T>
void rms_norm_rows(T* out, const T* x, const T* w, int64_t hidden, double eps) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < hidden; ++i) {
    const float v = to_f(x[i]);
    ss += v * v;
  }
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

// Calls f(C{}) with C the C++ type of a KV cache dtype (it may differ from the
// activations': float16 caches halve the bytes attention reads, int8 ones
// halve them again).
template <typename F>
void dispatch_cache_type(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat: return f(float{});
    case at::kHalf: return f(at::Half{});
    case at::kBFloat16: return f(at::BFloat16{});
    case at::kChar: return f(int8_t{});
    default: TORCH_CHECK(false, "unsupported KV cache dtype ", t);
  }
}

// An int8 cache row is head_dim codes and then their float32 scale
// (models/kv_cache.py); float rows are the values alone.
constexpr int64_t kInt8ScaleBytes = sizeof(float);
template <typename C>
constexpr int64_t kRowExtra = std::is_same_v<C, int8_t> ? kInt8ScaleBytes : 0;

// Elements per (token, head) row of a cache tensor holding heads of head_dim.
inline int64_t cache_row(const at::Tensor& cache, int64_t head_dim) {
  return head_dim + (cache.scalar_type() == at::kChar ? kInt8ScaleBytes : 0);
}

// What a row's values are multiplied by: its stored scale (int8), else 1,
// which the compiler folds away.
template <typename C>
inline float row_scale(const C* row, int64_t head_dim) {
  if constexpr (std::is_same_v<C, int8_t>) {
    float s;
    std::memcpy(&s, row + head_dim, sizeof(float));
    return s;
  } else {
    return 1.0f;
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
// [num_blocks, block_size, KVH, D].
void rotary_and_cache(at::Tensor& qkv, const at::Tensor& rotations, const at::Tensor& positions,
                      at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping,
                      int64_t num_heads, int64_t num_kv_heads) {
  check_rows(qkv, "qkv");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
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
  const int64_t kv_width = num_kv_heads * head_dim, slot_width = num_kv_heads * row;
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
          for (int64_t h = 0; h < num_kv_heads; ++h) {
            store_row(kc + slots[t] * slot_width + h * row, k + h * head_dim, head_dim);
            store_row(vc + slots[t] * slot_width + h * row, k + kv_width + h * head_dim, head_dim);
          }
        }
      });
    });
  });
}

// max(s[0..n)), n >= 1. GCC keeps a float max reduction scalar (a chain of
// dependent vmaxss), so the AVX-512 build spells out the vector loop.
inline float row_max(const float* s, int64_t n) {
  float mx = s[0];
  int64_t t = 1;
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 m = _mm512_loadu_ps(s);
    for (t = 16; t + 16 <= n; t += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + t));
    mx = _mm512_reduce_max_ps(m);
  }
#endif
  for (; t < n; ++t) mx = std::max(mx, s[t]);
  return mx;
}

// Softmax of each of ``rows`` score rows of length n, in place.
inline void softmax_rows(float* s, int64_t rows, int64_t n) {
  for (int64_t g = 0; g < rows; ++g, s += n) {
    float mx = row_max(s, n);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; ++t) {
      s[t] = exp_approx(s[t] - mx);
      sum += s[t];
    }
    const float inv = 1.0f / sum;
#pragma omp simd
    for (int64_t t = 0; t < n; ++t) s[t] *= inv;
  }
}

#if defined(__AVX512F__)
// 16 cache values as float32 (the compiler does not vectorise c10::Half's or
// BFloat16's conversion; the hardware does, 16 values at a time).
template <typename C>
inline __m512 load16(const C* p);
template <>
inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <>
inline __m512 load16<at::Half>(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
template <>
inline __m512 load16<at::BFloat16>(const at::BFloat16* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
template <>
inline __m512 load16<int8_t>(const int8_t* p) {  // the codes; the caller applies the row's scale
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#endif

// Rows of a length divisible by 16 go 16 values at a time through load16.
template <typename T>
inline float dot_row(const float* q, const T* k, int64_t n) {
#if defined(__AVX512F__)
  if (n % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t d = 0; d < n; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16(k + d), acc);
    return _mm512_reduce_add_ps(acc);
  }
#endif
  float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
  for (int64_t d = 0; d < n; ++d) dot += q[d] * to_f(k[d]);
  return dot;
}

template <typename T>
inline void axpy_row(float* acc, float p, const T* v, int64_t n) {
#if defined(__AVX512F__)
  if (n % 16 == 0) {
    const __m512 pv = _mm512_set1_ps(p);
    for (int64_t d = 0; d < n; d += 16) {
      _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(pv, load16(v + d), _mm512_loadu_ps(acc + d)));
    }
    return;
  }
#endif
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) acc[d] += p * to_f(v[d]);
}

// One sequence's view of the paged caches [num_blocks, block_size, KVH, D].
struct PagedView {
  int64_t block_size, token_stride;
  const int64_t* table;
};

// Calls f(t, row_offset) for t = 0..ctx-1 in order, block by block (no
// division per token): row_offset is where token t's row for this KV head
// starts in `cache`. Each block first asks for the next block's rows
// (`row_bytes` each): blocks sit anywhere in the cache, so the hardware
// prefetcher cannot guess the next one, and a decode step at 64 sequences
// waits on memory.
template <typename C, typename F>
inline void for_each_token(const C* cache, int64_t row_bytes, const PagedView& pv, int64_t head_offset, int64_t ctx,
                           F&& f) {
  const int64_t blocks = (ctx + pv.block_size - 1) / pv.block_size;
  for (int64_t start = 0, i = 0; start < ctx; start += pv.block_size, ++i) {
    if (i + 1 < blocks) {
      const int64_t n_next = std::min(pv.block_size, ctx - start - pv.block_size);
      const char* row = reinterpret_cast<const char*>(cache + pv.table[i + 1] * pv.block_size * pv.token_stride +
                                                      head_offset);
      for (int64_t j = 0; j < n_next; ++j, row += pv.token_stride * sizeof(C)) {
        for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(row + b);
      }
    }
    const int64_t n = std::min(pv.block_size, ctx - start);
    int64_t off = pv.table[i] * pv.block_size * pv.token_stride + head_offset;
    for (int64_t j = 0; j < n; ++j, off += pv.token_stride) f(start + j, off);
  }
}

#if defined(__AVX512F__)
using kvserve::sum16;

// The G query heads of one KV head, scores over ``ctx`` tokens: each key row
// is loaded (and converted) once for all G heads, the queries held in
// registers. Each token's G products wait, unreduced, until 16 tokens are in;
// sum16 then reduces them together.
template <typename C, int HD, int G>
inline void scores_avx512(float* s, const float* q, const C* kc, const PagedView& pv, int64_t head_offset,
                          int64_t ctx) {
  constexpr int kVecs = HD / 16;
  __m512 qv[G][kVecs];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < kVecs; ++i) qv[g][i] = _mm512_loadu_ps(q + g * HD + 16 * i);
  alignas(64) float parts[G][16][16];
  alignas(64) float scales[16];  // the key rows' int8 scales
  const auto flush = [&](int64_t first, int n) {
    for (int g = 0; g < G; ++g) {
      __m512 v[16];
      for (int j = 0; j < 16; ++j) v[j] = j < n ? _mm512_load_ps(parts[g][j]) : _mm512_setzero_ps();
      __m512 sums = sum16(v);
      if constexpr (kRowExtra<C> > 0) sums = _mm512_mul_ps(sums, _mm512_load_ps(scales));
      _mm512_mask_storeu_ps(s + g * ctx + first, static_cast<__mmask16>((1u << n) - 1), sums);
    }
  };
  for_each_token(kc, (HD + kRowExtra<C>) * sizeof(C), pv, head_offset, ctx, [&](int64_t t, int64_t off) {
    __m512 k[kVecs];
    for (int i = 0; i < kVecs; ++i) k[i] = load16(kc + off + 16 * i);
    const int j = static_cast<int>(t % 16);
    if constexpr (kRowExtra<C> > 0) scales[j] = row_scale(kc + off, HD);
    for (int g = 0; g < G; ++g) {
      __m512 acc = _mm512_mul_ps(qv[g][0], k[0]);
      for (int i = 1; i < kVecs; ++i) acc = _mm512_fmadd_ps(qv[g][i], k[i], acc);
      _mm512_store_ps(parts[g][j], acc);
    }
    if (j == 15) flush(t - 15, 16);
  });
  if (ctx % 16) flush(ctx - ctx % 16, static_cast<int>(ctx % 16));
}

// sum_t p[g][t] * v[t] for the G query heads, each value row loaded once and
// the accumulators held in registers (through memory, each token's add would
// wait for the previous store).
template <typename C, int HD, int G>
inline void values_avx512(float* out, const float* p, const C* vc, const PagedView& pv, int64_t head_offset,
                          int64_t ctx) {
  constexpr int kVecs = HD / 16;
  __m512 acc[G][kVecs];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < kVecs; ++i) acc[g][i] = _mm512_setzero_ps();
  for_each_token(vc, (HD + kRowExtra<C>) * sizeof(C), pv, head_offset, ctx, [&](int64_t t, int64_t off) {
    __m512 v[kVecs];
    for (int i = 0; i < kVecs; ++i) v[i] = load16(vc + off + 16 * i);
    const float vs = row_scale(vc + off, HD);
    for (int g = 0; g < G; ++g) {
      const __m512 pt = _mm512_set1_ps(p[g * ctx + t] * vs);
      for (int i = 0; i < kVecs; ++i) acc[g][i] = _mm512_fmadd_ps(pt, v[i], acc[g][i]);
    }
  });
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < kVecs; ++i) _mm512_storeu_ps(out + g * HD + 16 * i, acc[g][i]);
}

// Query heads per pass over the cache: registers hold G x HD/16 query (or
// accumulator) vectors, so G <= 4 at head size 64 and G <= 2 at 128.
template <int HD>
constexpr int kMaxGroup = HD <= 64 ? 4 : 2;

// Runs f(integral_constant<G>, first_head) over the group in passes of up to kMaxGroup<HD> heads.
template <int HD, typename F>
inline void for_head_passes(int64_t group, F&& f) {
  constexpr int M = kMaxGroup<HD>;
  int64_t g = 0;
  for (; g + M <= group; g += M) f(std::integral_constant<int, M>{}, g);
  const int64_t rest = group - g;
  if (rest == 1) f(std::integral_constant<int, 1>{}, g);
  if constexpr (M >= 4) {
    if (rest == 2) f(std::integral_constant<int, 2>{}, g);
    if (rest == 3) f(std::integral_constant<int, 3>{}, g);
  }
}
#endif

// The ``group`` query heads sharing one KV head, for one sequence of ``ctx``
// tokens: scores, softmax, weighted sum of values. ``qf`` is pre-scaled.
// HD is the head size when known at compile time (0: read ``head_dim``), so
// the common sizes get fully unrolled, register-resident loops.
template <typename T, typename C, int HD>
void attend_group(T* out, const float* qf, const C* kc, const C* vc, const PagedView& pv, int64_t head_offset,
                  int64_t head_dim, int64_t group, int64_t ctx, std::vector<float>& scores,
                  std::vector<float>& acc) {
  const int64_t hd = HD ? HD : head_dim;
  scores.resize(group * ctx);
  float* s = scores.data();
  acc.assign(group * hd, 0.0f);
  float* a = acc.data();
#if defined(__AVX512F__)
  if constexpr (HD > 0 && HD % 16 == 0) {
    for_head_passes<HD>(group, [&](auto n, int64_t g) {
      scores_avx512<C, HD, decltype(n)::value>(s + g * ctx, qf + g * hd, kc, pv, head_offset, ctx);
    });
    softmax_rows(s, group, ctx);
    for_head_passes<HD>(group, [&](auto n, int64_t g) {
      values_avx512<C, HD, decltype(n)::value>(a + g * hd, s + g * ctx, vc, pv, head_offset, ctx);
    });
    for (int64_t i = 0; i < group * hd; ++i) out[i] = static_cast<T>(a[i]);
    return;
  }
#endif
  const int64_t row_bytes = (hd + kRowExtra<C>) * sizeof(C);
  for_each_token(kc, row_bytes, pv, head_offset, ctx, [&](int64_t t, int64_t off) {
    const C* k = kc + off;
    const float ks = row_scale(k, hd);
    for (int64_t g = 0; g < group; ++g) s[g * ctx + t] = dot_row(qf + g * hd, k, hd) * ks;
  });
  softmax_rows(s, group, ctx);
  for_each_token(vc, row_bytes, pv, head_offset, ctx, [&](int64_t t, int64_t off) {
    const C* v = vc + off;
    const float vs = row_scale(v, hd);
    for (int64_t g = 0; g < group; ++g) axpy_row(a + g * hd, s[g * ctx + t] * vs, v, hd);
  });
  for (int64_t i = 0; i < group * hd; ++i) out[i] = static_cast<T>(a[i]);
}

template <typename T, typename C>
void decode_attention_impl(T* out, const T* q, int64_t q_stride, const C* kc, const C* vc,
                           const int64_t* tables, const int64_t* lens, int64_t batch, int64_t heads,
                           int64_t kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,
                           float scale) {
  const int64_t group = heads / kv_heads;
  const int64_t row = head_dim + kRowExtra<C>;  // cache elements per (token, head)
  const auto attend = head_dim == 64    ? attend_group<T, C, 64>
                      : head_dim == 128 ? attend_group<T, C, 128>
                                        : attend_group<T, C, 0>;
  kvserve::parallel_chunks(batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    // Per thread, reused across chunks and calls (a chunk is one item).
    thread_local std::vector<float> qf, scores, acc;
    qf.resize(group * head_dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / kv_heads, h = item % kv_heads;
      const T* src = q + b * q_stride + h * group * head_dim;
      for (int64_t i = 0; i < group * head_dim; ++i) qf[i] = to_f(src[i]) * scale;
      const PagedView pv{block_size, kv_heads * row, tables + b * max_blocks};
      attend(out + (b * heads + h * group) * head_dim, qf.data(), kc, vc, pv, h * row, head_dim, group,
             lens[b], scores, acc);
    }
  });
}

// The shapes both paged attention kernels read, checked: q [N, H, D] with
// packed heads (rows may be strided), out like q, caches [NB, BS, KVH, row],
// one block table and context length per sequence, every block a context
// touches inside the cache.
struct PagedShapes {
  int64_t heads, head_dim, block_size, kv_heads, max_blocks;
  const int64_t* tables;
  const int64_t* lens;
};

PagedShapes check_paged(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& context_lens) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q must be [N, H, D] with packed heads");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "out must be contiguous like q");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V caches must share a dtype");
  TORCH_CHECK(block_tables.is_contiguous() && block_tables.scalar_type() == at::kLong && block_tables.dim() == 2,
              "block_tables: int64 [S, max_blocks]");
  TORCH_CHECK(context_lens.is_contiguous() && context_lens.scalar_type() == at::kLong, "context_lens: int64");
  const int64_t heads = q.size(1), head_dim = q.size(2);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == cache_row(k_cache, head_dim) && heads % kv_heads == 0, "cache shape does not match q");
  const int64_t seqs = context_lens.numel(), max_blocks = block_tables.size(1);
  TORCH_CHECK(block_tables.size(0) == seqs, "one table and length per sequence");
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < seqs; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= max_blocks * block_size, "context length ", lens[b], " out of range");
    for (int64_t i = 0; i < (lens[b] + block_size - 1) / block_size; ++i) {
      const int64_t blk = tables[b * max_blocks + i];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "block id ", blk, " out of range");
    }
  }
  return {heads, head_dim, block_size, kv_heads, max_blocks, tables, lens};
}

// One query token per sequence over its paged context, read in place (no
// gather). q [B, H, D] (rows may be strided), caches [NB, BS, KVH, D] (int8:
// [NB, BS, KVH, D + 4], each row's scale after its codes),
// block_tables [B, max_blocks] int64, context_lens [B] int64; out [B, H, D].
// The H / KVH query heads sharing a KV head are handled together so each key
// and value row is read once per sequence.
void paged_decode_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale) {
  const PagedShapes p = check_paged(out, q, k_cache, v_cache, block_tables, context_lens);
  TORCH_CHECK(context_lens.numel() == q.size(0), "one query token per sequence");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    dispatch_cache_type(k_cache.scalar_type(), [&](auto cache_tag) {
      using C = decltype(cache_tag);
      decode_attention_impl(out.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(), q.stride(0),
                            static_cast<const C*>(k_cache.data_ptr()), static_cast<const C*>(v_cache.data_ptr()),
                            p.tables, p.lens, q.size(0), p.heads, p.kv_heads, p.head_dim, p.block_size,
                            p.max_blocks, static_cast<float>(scale));
    });
  });
}

// ---------------------------------------------------------------- prefill attention

// Query tokens per work item, and keys per softmax update (a tile of each).
constexpr int64_t kQueryTile = 16;
constexpr int64_t kKeyTile = 16;

// One cache row as float32 (times its int8 scale), 16 values at a time where the
// hardware converts them.
template <typename C>
inline void row_to_float(float* dst, const C* row, int64_t d) {
  const float s = row_scale(row, d);
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= d; i += 16) _mm512_storeu_ps(dst + i, _mm512_mul_ps(load16(row + i), _mm512_set1_ps(s)));
#endif
  for (; i < d; ++i) dst[i] = to_f(row[i]) * s;
}

#if defined(__AVX512F__)
// exp_approx on 16 lanes: the same clamp, split and polynomial (kExp2Poly).
inline __m512 exp_approx16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 fi = _mm512_roundscale_ps(_mm512_add_ps(t, _mm512_set1_ps(0.5f)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, fi);
  __m512 p = _mm512_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < 7; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Poly[i]));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fi), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// R consecutive query rows (q, acc: [R][d]) against one key tile (kt: [d][16]
// keys transposed, vt: [16][d] values; row r sees the first valid[r] keys):
// scores in one vector per row, the online softmax update of (max, sum), and
// acc = acc * alpha + p @ vt. Several rows at once share each key and value
// load and keep 2R independent FMA chains in flight (one row alone waits on
// its FMAs' latency).
template <int R>
inline void prefill_rows_avx512(const float* q, float* acc, const float* kt, const float* vt, int64_t d,
                                const int64_t* valid, float* max, float* sum) {
  __m512 s0[R], s1[R];
  for (int r = 0; r < R; ++r) s0[r] = s1[r] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 2 <= d; i += 2) {
    const __m512 k0 = _mm512_loadu_ps(kt + i * 16), k1 = _mm512_loadu_ps(kt + (i + 1) * 16);
    for (int r = 0; r < R; ++r) {
      s0[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * d + i]), k0, s0[r]);
      s1[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * d + i + 1]), k1, s1[r]);
    }
  }
  for (; i < d; ++i)
    for (int r = 0; r < R; ++r) s0[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * d + i]), _mm512_loadu_ps(kt + i * 16), s0[r]);
  alignas(64) float pv[R][16];
  __m512 alpha[R];
  int64_t keys = 0;
  for (int r = 0; r < R; ++r) {
    const __m512 sc = _mm512_add_ps(s0[r], s1[r]);
    const __mmask16 mask = static_cast<__mmask16>((1u << valid[r]) - 1);
    const float m = std::max(max[r], _mm512_mask_reduce_max_ps(mask, sc));
    const float a = exp_approx(max[r] - m);  // 0 on the first tile (max = -inf, clamped)
    const __m512 p = _mm512_maskz_mov_ps(mask, exp_approx16(_mm512_sub_ps(sc, _mm512_set1_ps(m))));
    max[r] = m;
    sum[r] = sum[r] * a + _mm512_reduce_add_ps(p);
    _mm512_store_ps(pv[r], p);
    alpha[r] = _mm512_set1_ps(a);
    keys = std::max(keys, valid[r]);
  }
  for (int64_t i0 = 0; i0 < d; i0 += 16) {
    __m512 o[R];
    for (int r = 0; r < R; ++r) o[r] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * d + i0), alpha[r]);
    for (int64_t j = 0; j < keys; ++j) {
      const __m512 v = _mm512_loadu_ps(vt + j * d + i0);
      for (int r = 0; r < R; ++r) o[r] = _mm512_fmadd_ps(_mm512_set1_ps(pv[r][j]), v, o[r]);
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc + r * d + i0, o[r]);
  }
}
#endif

// The attention of one tile of up to kQueryTile query tokens of one sequence,
// for the `group` query heads of KV head h, over keys 0..(its last position),
// read from the paged caches: a flash-attention pass over key tiles with an
// online softmax, so no [queries x context] score matrix is formed. Rows r of
// the tile are (token r / group, head r % group).
struct PrefillTile {
  const int64_t* table;  // the sequence's block table
  int64_t first_pos;     // position of the tile's first query token
  int64_t tokens;        // query tokens in the tile
};

template <typename T, typename C>
void prefill_tile(T* out, int64_t out_stride, const T* q, int64_t q_stride, const C* kc, const C* vc,
                  const PrefillTile& tile, int64_t h, int64_t group, int64_t d, int64_t kv_heads,
                  int64_t block_size, float scale, std::vector<float>& buf) {
  const int64_t rows = tile.tokens * group;
  const int64_t row = d + kRowExtra<C>, token_stride = kv_heads * row;
  buf.resize(rows * d * 2 + rows * 2 + d * kKeyTile * 2 + d);
  float* qf = buf.data();      // [rows][d], scaled
  float* acc = qf + rows * d;  // [rows][d]
  float* mx = acc + rows * d;  // [rows] running max of the scores
  float* sum = mx + rows;      // [rows] running sum of exp(score - max)
  float* kt = sum + rows;      // [d][kKeyTile]: this key tile, transposed
  float* vt = kt + d * kKeyTile;  // [kKeyTile][d]
  float* tmp = vt + kKeyTile * d;  // [d]: one key row
  thread_local std::vector<int64_t> valid_keys;  // per row: how many of the tile's keys it sees
  valid_keys.resize(rows);
  int64_t* valid = valid_keys.data();
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = q + (r / group) * q_stride + (h * group + r % group) * d;
    for (int64_t i = 0; i < d; ++i) qf[r * d + i] = to_f(src[i]) * scale;
    std::fill(acc + r * d, acc + (r + 1) * d, 0.0f);
    mx[r] = -std::numeric_limits<float>::infinity();
    sum[r] = 0.0f;
  }
  const int64_t end = tile.first_pos + tile.tokens;  // keys 0..end-1 are seen by some row
  for (int64_t k0 = 0; k0 < end; k0 += kKeyTile) {
    const int64_t nk = std::min(kKeyTile, end - k0);
    for (int64_t j = 0; j < kKeyTile; ++j) {
      if (j < nk) {
        const int64_t pos = k0 + j;
        const int64_t off = (tile.table[pos / block_size] * block_size + pos % block_size) * token_stride + h * row;
        row_to_float(tmp, kc + off, d);
        for (int64_t i = 0; i < d; ++i) kt[i * kKeyTile + j] = tmp[i];
        row_to_float(vt + j * d, vc + off, d);
      } else {
        for (int64_t i = 0; i < d; ++i) kt[i * kKeyTile + j] = 0.0f;
      }
    }
    // Rows before the tile's first key see none of it; every later row sees some.
    const int64_t first = std::max<int64_t>(0, (k0 - tile.first_pos) * group);
    for (int64_t r = first; r < rows; ++r) valid[r] = std::min(nk, tile.first_pos + r / group - k0 + 1);
    int64_t r = first;
#if defined(__AVX512F__)
    if (d % 16 == 0) {
      for (; r + 4 <= rows; r += 4) prefill_rows_avx512<4>(qf + r * d, acc + r * d, kt, vt, d, valid + r, mx + r, sum + r);
      for (; r < rows; ++r) prefill_rows_avx512<1>(qf + r * d, acc + r * d, kt, vt, d, valid + r, mx + r, sum + r);
    }
#endif
    for (; r < rows; ++r) {
      float* ar = acc + r * d;
      float s[kKeyTile];
      for (int64_t j = 0; j < kKeyTile; ++j) s[j] = 0.0f;
      const float* qr = qf + r * d;
      for (int64_t i = 0; i < d; ++i) {
        const float qi = qr[i];
#pragma omp simd
        for (int64_t j = 0; j < kKeyTile; ++j) s[j] += qi * kt[i * kKeyTile + j];
      }
      float m = mx[r];
      for (int64_t j = 0; j < valid[r]; ++j) m = std::max(m, s[j]);
      const float alpha = exp_approx(mx[r] - m);  // 0 on the first tile (mx = -inf, clamped)
      float p[kKeyTile], psum = 0.0f;
      for (int64_t j = 0; j < kKeyTile; ++j) {
        p[j] = j < valid[r] ? exp_approx(s[j] - m) : 0.0f;
        psum += p[j];
      }
      mx[r] = m;
      sum[r] = sum[r] * alpha + psum;
      for (int64_t i = 0; i < d; ++i) {
        float a = ar[i] * alpha;
        for (int64_t j = 0; j < valid[r]; ++j) a += p[j] * vt[j * d + i];
        ar[i] = a;
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = out + (r / group) * out_stride + (h * group + r % group) * d;
    const float inv = 1.0f / sum[r];
    for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<T>(acc[r * d + i] * inv);
  }
}

// Causal attention for sequences of several query tokens each (prompts, or
// chunks of them after a cached prefix): sequence i's tokens are rows
// starts[i]..starts[i+1]-1 of q and the last of its lens[i] positions, whose
// K/V are already in the caches. One work item per (sequence, KV head, tile
// of kQueryTile tokens); later tiles see more keys, so items are claimed one
// at a time (parallel_chunks), the costliest first, rather than split evenly.
template <typename T, typename C>
void prefill_attention_impl(T* out, const T* q, int64_t q_stride, const C* kc, const C* vc, const int64_t* tables,
                            const int64_t* lens, const int64_t* starts, int64_t seqs, int64_t heads,
                            int64_t kv_heads, int64_t d, int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t group = heads / kv_heads;
  std::vector<int64_t> first_item(seqs + 1, 0);  // items of sequence i: first_item[i]..first_item[i+1]-1
  for (int64_t i = 0; i < seqs; ++i) {
    const int64_t tiles = (starts[i + 1] - starts[i] + kQueryTile - 1) / kQueryTile;
    first_item[i + 1] = first_item[i] + tiles * kv_heads;
  }
  kvserve::parallel_chunks(first_item[seqs], 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> buf;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = std::upper_bound(first_item.begin(), first_item.end(), item) - first_item.begin() - 1;
      const int64_t qlen = starts[i + 1] - starts[i], tiles = (qlen + kQueryTile - 1) / kQueryTile;
      // Last tiles first: they see the most keys, and the cheap ones at the end
      // even out the threads' finishing times.
      const int64_t local = item - first_item[i], tile = tiles - 1 - local / kv_heads, h = local % kv_heads;
      const int64_t t0 = tile * kQueryTile, row0 = starts[i] + t0;
      const PrefillTile pt{tables + i * max_blocks, lens[i] - qlen + t0, std::min(kQueryTile, qlen - t0)};
      prefill_tile(out + row0 * heads * d, heads * d, q + row0 * q_stride, q_stride, kc, vc, pt, h, group, d,
                   kv_heads, block_size, scale, buf);
    }
  });
}

// q [T, H, D] (rows may be strided) holds the query tokens of S sequences,
// sequence i's at rows query_start[i]..query_start[i+1]-1, the last of its
// context_lens[i] positions; caches as paged_decode_attention's; out [T, H, D].
void paged_prefill_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_tables,
                             const at::Tensor& context_lens, const at::Tensor& query_start, double scale) {
  const PagedShapes p = check_paged(out, q, k_cache, v_cache, block_tables, context_lens);
  const int64_t seqs = context_lens.numel();
  TORCH_CHECK(query_start.is_contiguous() && query_start.scalar_type() == at::kLong && query_start.numel() == seqs + 1,
              "query_start: int64, one more than the sequences");
  const int64_t* starts = query_start.data_ptr<int64_t>();
  TORCH_CHECK(starts[0] == 0 && starts[seqs] == q.size(0), "query_start must run from 0 to the number of tokens");
  for (int64_t i = 0; i < seqs; ++i) {
    const int64_t qlen = starts[i + 1] - starts[i];
    TORCH_CHECK(qlen >= 1 && qlen <= p.lens[i], "sequence ", i, ": ", qlen, " query tokens, context length ", p.lens[i]);
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_prefill_attention", [&] {
    dispatch_cache_type(k_cache.scalar_type(), [&](auto cache_tag) {
      using C = decltype(cache_tag);
      prefill_attention_impl(out.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(), q.stride(0),
                             static_cast<const C*>(k_cache.data_ptr()), static_cast<const C*>(v_cache.data_ptr()),
                             p.tables, p.lens, starts, seqs, p.heads, p.kv_heads, p.head_dim, p.block_size,
                             p.max_blocks, static_cast<float>(scale));
    });
  });
}


// ---------------------------------------------------------------- argmax

// Whether v wins over m: larger, or NaN over a number (torch.argmax's order).
inline bool beats(float v, float m) { return v > m || (std::isnan(v) && !std::isnan(m)); }

// The index of the row's winning value, the first one on ties.
inline int64_t argmax_row(const float* x, int64_t n) {
  int64_t best = 0, i = 1;
  float m = x[0];
#if defined(__AVX512F__)
  if (n >= 32) {
    // Lane l follows indices l, l + 16, ...; a strict win keeps its first.
    __m512 mv = _mm512_loadu_ps(x);
    __m512i iv = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i cur = iv;
    const __m512i step = _mm512_set1_epi32(16);
    for (i = 16; i + 16 <= n; i += 16) {
      cur = _mm512_add_epi32(cur, step);
      const __m512 v = _mm512_loadu_ps(x + i);
      const __mmask16 win = _mm512_cmp_ps_mask(v, mv, _CMP_GT_OQ) |
                            (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) & ~_mm512_cmp_ps_mask(mv, mv, _CMP_UNORD_Q));
      mv = _mm512_mask_mov_ps(mv, win, v);
      iv = _mm512_mask_mov_epi32(iv, win, cur);
    }
    alignas(64) float vals[16];
    alignas(64) int32_t idx[16];
    _mm512_store_ps(vals, mv);
    _mm512_store_si512(idx, iv);
    m = vals[0];
    best = idx[0];
    for (int l = 1; l < 16; ++l) {
      // Neither wins (equal, or both NaN): the earlier index.
      if (beats(vals[l], m) || (!beats(m, vals[l]) && idx[l] < best)) {
        m = vals[l];
        best = idx[l];
      }
    }
  }
#endif
  for (; i < n; ++i) {  // indices above every one seen: a strict win only
    if (beats(x[i], m)) {
      m = x[i];
      best = i;
    }
  }
  return best;
}

// out[r] = argmax(x[r]) for float32 x [S, V] (rows may be strided): the
// greedy sampler's step, one pass over each row (torch's argmax takes about
// 5 ms for 64 rows of a 49152-token vocabulary here).
void argmax_rows(at::Tensor& out, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat && x.size(1) >= 1,
              "x must be float32 [S, V] with V >= 1 and contiguous rows");
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kLong && out.numel() == x.size(0),
              "out must be int64 [S]");
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t n = x.size(1), xs = x.stride(0);
  kvserve::parallel_chunks(x.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * xs, n);
  });
}
}  // namespace

// grouped_gemm.cpp
void grouped_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                    bool int8_activations, bool plain);
bool has_vnni();

namespace {

// One decoder layer for a step's batch, float32 activations, every projection
// packed (grouped_linear's codes and scales): the same kernels the Python
// layer calls one by one, in one call, so a step pays no per-op Python
// dispatch. The batch is num_decodes decodes (one token per sequence), then,
// when prefill_query_start is given, prompt chunks (rows num_decodes + its
// offsets, the sequences after the decodes in block_tables and context_lens).
// Returns (mlp_out, residual); ``residual`` is None on the first layer, where x
// is the embedding output and becomes the residual stream.
std::vector<at::Tensor> fused_layer(
    const at::Tensor& x, const c10::optional<at::Tensor>& residual_in, const at::Tensor& input_norm,
    const at::Tensor& post_norm, double eps, const std::vector<at::Tensor>& qkv,
    const c10::optional<at::Tensor>& qkv_bias, const std::vector<at::Tensor>& o_proj,
    const std::vector<at::Tensor>& gate_up, const std::vector<at::Tensor>& down, const at::Tensor& rotations,
    const at::Tensor& positions, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t num_heads, int64_t num_kv_heads,
    double scale, bool int8_activations, int64_t num_decodes, const c10::optional<at::Tensor>& prefill_query_start) {
  TORCH_CHECK(qkv.size() == 2 && o_proj.size() == 2 && gate_up.size() == 2 && down.size() == 2,
              "each projection is (codes, scales)");
  const int64_t rows = x.size(0), hidden = x.size(1);
  const int64_t head_dim = rotations.size(1) * 2;
  const int64_t qkv_width = (num_heads + 2 * num_kv_heads) * head_dim;
  const auto opts = x.options();
  at::Tensor h = at::empty({rows, hidden}, opts);
  at::Tensor residual;
  if (residual_in.has_value()) {
    residual = *residual_in;
    add_rms_norm(h, residual, x, input_norm, eps);
  } else {
    residual = x;
    rms_norm(h, x, input_norm, eps);
  }
  at::Tensor qkv_out = at::empty({rows, qkv_width}, opts);
  grouped_linear(qkv_out, h, qkv[0], qkv[1], int8_activations, false);
  if (qkv_bias.has_value()) qkv_out.add_(*qkv_bias);
  rotary_and_cache(qkv_out, rotations, positions, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads);
  const at::Tensor q = qkv_out.narrow(1, 0, num_heads * head_dim).view({rows, num_heads, head_dim});
  at::Tensor attn = at::empty({rows, num_heads, head_dim}, opts);
  if (!prefill_query_start.has_value()) {
    paged_decode_attention(attn, q, k_cache, v_cache, block_tables, context_lens, scale);
  } else {
    const int64_t seqs = context_lens.numel(), d = num_decodes;
    TORCH_CHECK(d >= 0 && d < seqs && d < rows, "num_decodes ", d, " out of range");
    if (d > 0) {
      at::Tensor head = attn.narrow(0, 0, d);
      paged_decode_attention(head, q.narrow(0, 0, d), k_cache, v_cache, block_tables.narrow(0, 0, d),
                             context_lens.narrow(0, 0, d), scale);
    }
    at::Tensor tail = attn.narrow(0, d, rows - d);
    paged_prefill_attention(tail, q.narrow(0, d, rows - d), k_cache, v_cache, block_tables.narrow(0, d, seqs - d),
                            context_lens.narrow(0, d, seqs - d), *prefill_query_start, scale);
  }
  at::Tensor o = at::empty({rows, hidden}, opts);
  grouped_linear(o, attn.view({rows, num_heads * head_dim}), o_proj[0], o_proj[1], int8_activations, false);
  add_rms_norm(h, residual, o, post_norm, eps);
  const int64_t inter = down[0].size(1) * 32;  // down's input width = the intermediate size
  at::Tensor gu = at::empty({rows, 2 * inter}, opts);
  grouped_linear(gu, h, gate_up[0], gate_up[1], int8_activations, false);
  at::Tensor act = at::empty({rows, inter}, opts);
  silu_and_mul(act, gu);
  at::Tensor out = at::empty({rows, hidden}, opts);
  grouped_linear(out, act, down[0], down[1], int8_activations, false);
  return {out, residual};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("grouped_linear", &grouped_linear, "out = x @ W^T, W packed in 4- or 8-bit groups of 32 (float scales)",
        py::call_guard<py::gil_scoped_release>());
  m.def("has_vnni", &has_vnni, "whether the int8-activation GEMMs run on AVX512-VNNI");
  m.def("fused_layer", &fused_layer, "one decoder layer for a step's decodes and prompt chunks, packed projections",
        py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "out = rms_norm(x) * weight");
  m.def("add_rms_norm", &add_rms_norm, "residual += x; out = rms_norm(residual) * weight");
  m.def("silu_and_mul", &silu_and_mul, "out = silu(gate) * up");
  m.def("rotary_and_cache", &rotary_and_cache, "rotate Q/K in place and write K/V to the paged caches");
  m.def("paged_decode_attention", &paged_decode_attention, "one-token attention over paged caches",
        py::call_guard<py::gil_scoped_release>());
  m.def("argmax_rows", &argmax_rows, "index of each row's largest value (first on ties, NaN largest)",
        py::call_guard<py::gil_scoped_release>());
  m.def("paged_prefill_attention", &paged_prefill_attention, "causal attention of prompt chunks over paged caches",
        py::call_guard<py::gil_scoped_release>());
}

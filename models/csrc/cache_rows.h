// The KV cache's row formats as the kernels read and write them: the C++ type
// of each cache dtype, an int8 row's scale, and 16 values at a time as float32.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "fastmath.h"
#include "vec16.h"

namespace kvserve {

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
inline constexpr int64_t kInt8ScaleBytes = sizeof(float);
template <typename C>
inline constexpr int64_t kRowExtra = std::is_same_v<C, int8_t> ? kInt8ScaleBytes : 0;

// Elements per (token, head) row of a cache tensor holding heads of head_dim.
inline int64_t cache_row(const at::Tensor& cache, int64_t head_dim) {
  return head_dim + (cache.scalar_type() == at::kChar ? kInt8ScaleBytes : 0);
}

// Where a pair of caches [NB, BS, KVH, row] keeps its rows, in elements: row (token t, head h)
// of block b starts at b * block + t * token + h * head. A block's rows are packed in one of
// two orders: head-major (each head's BS rows one run: models/kv_cache.py allocates these,
// token = row, head = BS * row) or token-major (each token's KVH rows one run: a contiguous
// tensor, token = KVH * row, head = row). Blocks lie `block` apart, at least a block's rows (a
// layer whose rows are smaller than its slot's largest views the start of each block;
// models/kv_cache.py). K and V alike.
struct CacheStrides {
  int64_t block, token, head;
};

inline CacheStrides cache_strides(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides(),
              "K and V caches must be [NB, BS, KVH, row] of one shape and layout");
  const int64_t bs = k_cache.size(1), heads = k_cache.size(2), row = k_cache.size(3);
  const int64_t token = k_cache.stride(1), head = k_cache.stride(2);
  const bool head_major = token == row && head == bs * row, token_major = head == row && token == heads * row;
  TORCH_CHECK(k_cache.stride(3) == 1 && (head_major || token_major) && k_cache.stride(0) >= bs * heads * row,
              "caches must be packed within each block, head-major or token-major");
  return {k_cache.stride(0), token, head};
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

#if defined(KVSERVE_V16)
// 16 cache values as float32 (the compiler does not vectorise c10::Half's or
// BFloat16's conversion; the hardware does, 16 values at a time).
template <typename C>
inline V16 load16(const C* p);
template <>
inline V16 load16<float>(const float* p) { return v16_load(p); }
template <>
inline V16 load16<at::Half>(const at::Half* p) { return v16_load_half(p); }
template <>
inline V16 load16<at::BFloat16>(const at::BFloat16* p) { return v16_load_bf16(p); }
template <>
inline V16 load16<int8_t>(const int8_t* p) { return v16_load_int8(p); }  // the codes; the caller applies the row's scale
#endif

// The sum over d < n of q[d] k[d] in a fixed order: rows of a length divisible by 16 go 16
// values at a time through load16 (multiply-added from the front, then v16_reduce_add's
// order), others one by one. A row's result depends on its values alone.
template <typename T>
inline float dot_row(const float* q, const T* k, int64_t n) {
#if defined(KVSERVE_V16)
  if (n % 16 == 0) {
    V16 acc = v16_zero();
    for (int64_t d = 0; d < n; d += 16) acc = v16_fmadd(v16_load(q + d), load16(k + d), acc);
    return v16_reduce_add(acc);
  }
#endif
  float dot = 0.0f;  // in order: a vectorised reduction's order could depend on alignment
  for (int64_t d = 0; d < n; ++d) dot += q[d] * to_f(k[d]);
  return dot;
}

}  // namespace kvserve

// Reductions of 16 AVX-512 vectors at once, shared by the kernels.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

namespace kvserve {

// op over the lanes of each of 16 vectors, as one vector (lane i: op over
// v[i]'s lanes): a tree of lane shuffles and ops, about 3 instructions a
// vector where a horizontal reduction per vector takes 8. op is an
// associative, commutative lane-wise operation (_mm512_add_ps, _mm512_max_ps).
template <typename Op>
inline __m512 reduce16(const __m512* v, Op op) {
  __m512 a[8], c[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: v[2i] lanes 0+2, v[2i+1] 0+2, v[2i] 1+3, v[2i+1] 1+3
    a[i] = op(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: the lane's op over v[4i], ..., v[4i + 3]
    c[i] = op(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
              _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const auto pair_lanes = [&](__m512 x, __m512 y) {  // [x0 . x1, x2 . x3, y0 . y1, y2 . y3] by 128-bit lane
    return op(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
  };
  return pair_lanes(pair_lanes(c[0], c[1]), pair_lanes(c[2], c[3]));
}

inline __m512 sum16(const __m512* v) {
  return reduce16(v, [](__m512 x, __m512 y) { return _mm512_add_ps(x, y); });
}

inline __m512 max16(const __m512* v) {
  return reduce16(v, [](__m512 x, __m512 y) { return _mm512_max_ps(x, y); });
}

}  // namespace kvserve
#endif

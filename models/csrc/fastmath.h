// Float arithmetic the kernels share: storage values as float32, and exp(x)
// written so that it vectorises (scalar, and on 16 AVX-512 lanes).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace kvserve {

template <typename T>
inline float to_f(T v) { return static_cast<float>(v); }

// exp(x), written so the compiler vectorises it (std::exp is a scalar call):
// 2^(x log2 e) = 2^i * 2^f with i the nearest integer, f in [-0.5, 0.5), and
// 2^f by its degree-6 Taylor polynomial; relative error about 2e-7. Inputs
// are clamped to [-87, 88], where the result stays a normal float.
// kExp2Poly holds its coefficients, highest degree first (exp_approx16 is the
// same on 16 lanes).
inline constexpr float kExp2Poly[] = {0.0001540353f, 0.0013333558f, 0.0096181291f, 0.0555041087f,
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
#endif

}  // namespace kvserve

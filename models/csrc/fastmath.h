// Float arithmetic the kernels share: storage values as float32, and exp(x)
// written so that it vectorises (scalar, and on 16 lanes: vec16.h).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "vec16.h"

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

#if defined(KVSERVE_V16)
// exp_approx on 16 lanes: the same clamp, split and polynomial (kExp2Poly).
inline V16 exp_approx16(V16 x) {
  x = v16_min(v16_max(x, v16_set1(-87.0f)), v16_set1(88.0f));
  const V16 t = x * v16_set1(1.4426950408889634f);
  const V16 fi = v16_floor(t + v16_set1(0.5f));
  const V16 f = t - fi;
  V16 p = v16_set1(kExp2Poly[0]);
  for (int i = 1; i < 7; ++i) p = v16_fmadd(p, f, v16_set1(kExp2Poly[i]));
  const V16i bits = v16i_slli32(v16i_add(v16_round_to_int(fi), v16i_set1(127)), 23);
  return p * v16_as_float(bits);
}
#endif

}  // namespace kvserve

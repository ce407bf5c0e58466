// A GGUF file's tensors at their own bits on the int8-activation GEMMs (`--quantization w4a8`
// on a GGUF file): x's rows rounded to int8 per 16 inputs as grouped_gemm.cpp does, integer
// dots with the file's codes (vpdpbusd), each tensor's scales applied per group as its type
// defines them. The weights are the file's values exactly; only x is rounded.
//
// Formats (models/gguf_linear.py A8_FORMATS), each a segment's (codes, scales):
//   K4, K5: Q4_K's and Q5_K's codes (4-bit in grouped_gemm.cpp's layout, 5-bit as that layout
//           of their low 4 bits, then 64 bytes of their 5th: byte b of lane i holds, at bit t, that of byte b of
//           lane i of code vector t, as load_codes<8> gives them) with the
//           super-block's own scales: per 16-row tile and 256 inputs a record of 80 floats'
//           bytes, float16 D[16], M[16] (= -dmin: the file's d and dmin, exactly) then int8
//           sc[8][16] and mn[8][16]. A group's d = D sc and m = M mn are llama.cpp's float
//           products, made in the kernel: 4.625 bits a weight (Q4_K's 4.5; 5.625, Q5_K's 5.5).
//           (D and M were float32 until 2026-12-07: 4.75 bits, 2.7% more bytes a Q4_K weight.)
//   S16:    Q6_K's codes u = q + 32 in 6 bits, a scale per 16 inputs D sc: per group
//           the 4-bit layout of their low 4 bits, then 2 x 64 bytes of their high 2 (byte b of lane i
//           of the v-th holds, at bits 2t, those of byte b of lane i of code vector 4v + t, as
//           load_codes<8> gives them); a record of 72 floats' bytes per tile and 256 inputs,
//           float16 D[16] then int8 sc[8][2][16]. 6.5625 bits a weight, as Q6_K's.
//   K3:     Q3_K's codes u = q + 4 (0..7) in 3 bits, S16's scales: per group K2's two planes of
//           their low 2 bits, then 64 bytes of their 3rd (byte b of lane i holds, at bit t, that of
//           byte b of lane i of code vector t, as K5's 5th); S16's record (the file's float16 d,
//           its 6-bit scales less 32 as int8s). 3.5625 bits a weight, against Q3_K's 3.4375 (it
//           ran as S16, 6.5625, until 2026-12-07).
//   L4 (MX4, NL4, NX4): 4-bit indices into a table of 16 int8 values (MXFP4's E2M1 values doubled;
//           IQ4_NL's and IQ4_XS's codebook) in the 4-bit layout, and their d per row and 32 inputs:
//           MX4 the file's E8M0 exponent byte e ([tiles, K/32, 16]), d = 2^(e - 128) made in the
//           kernel (4.25 bits a weight, as MXFP4's); NL4 the file's float16 d (4.5 bits, as
//           IQ4_NL's); NX4 IQ4_XS's super-block scales, per tile and 256 inputs a record of 40
//           floats' bytes, float16 D[16] then int8 sc[8][16] (ls - 32), d = D sc made in the kernel
//           as llama.cpp makes it (4.3125 bits, against IQ4_XS's 4.25). The kernel looks the bytes up (vpshufb)
//           as u = value + c, then as S16 (c = 128; MXFP4 c = 16: bytes below 32, 5-bit codes).
//   K2:     Q2_K's codes u = q (0..3) in 2 bits: per group two 64-byte planes, byte b of lane i
//           of plane p holding, at bits 2t, byte b of lane i of code vector 4p + t (as
//           load_codes<8> gives them); per tile and 256 inputs a record of 80 floats' bytes,
//           float16 D[16], M[16] (= -dmin) then the file's bytes sc | mn << 4 [8][2][16], one
//           per 16 inputs: d = D sc and m = M mn, llama.cpp's products. 2.625 bits a weight, as
//           Q2_K's.
//   D4, D5, D8: symmetric codes in the 4-bit layout (Q4_0: u = q, c = 8), K5's (Q5_0: u = q + 16,
//           c = 16) or the 8-bit one (Q8_0: u = q + 128, c = 128) and the file's own float16 d per
//           row and 32 inputs ([tiles, K/32, 16] float16): 4.5, 5.5 and 8.5 bits a weight, as the
//           file's blocks; L4's arithmetic.
//   A4, A5: Q4_1's (u = q, c = 8) and Q5_1's codes (u = q, c = 16) as D4's and D5's, and the
//           file's float16 d and m per row and 32 inputs ([tiles, K/32, 2, 16] float16): 5 and 6
//           bits a weight, as the file's blocks; K's arithmetic with a d and m per group.
// Per group, with the dots s_h = sum(u qx) of each half h and qs_h = sum(qx) (grouped_rows.h):
//   K, A: y += d * (dx_1 (s_1 - c qs_1) + dx_0 (s_0 - c qs_0)) + (c d + m) * sum(x)   (c: 8; 5 bits 16)
//   S16, K3: y += d_0 * (dx_0 (s_0 - c qs_0)) + d_1 * (dx_1 (s_1 - c qs_1))   (c: 32; K3's 4)
//   K2:  y += dx_0 (d_0 s_0 + m_0 qs_0) + dx_1 (d_1 s_1 + m_1 qs_1)   (its m per 16 meets the
//        rounded x, as in llama.cpp's Q2_K dots: x's float sums come per 32)
//   L4, D: y += d * (dx_1 (s_1 - c qs_1) + dx_0 (s_0 - c qs_0))   (c: 128, MX4 16; D4's 8, D5's 16)
// s_h - c qs_h = sum((u - c) qx) is an integer below 2^24, exact in float (the vector code
// subtracts in integers, the plain C++ in floats: the same value); so the rounding of x
// meets the centred codes, as in grouped_gemm.cpp. A row's result does not depend on the
// rows beside it, and the plain C++ gives the vector code's bits (the same operations in order).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>

#include "gguf_a8_tiles.h"
#include "gguf_tables.h"
#include "grouped_rows.h"
#include "kernels.h"
#include "parallel.h"
#include "vec16.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace kvserve {
namespace {

using namespace grouped;

constexpr int64_t kSuper = 8;  // groups of 32 per super-block (256 inputs)

// Code u of row i (in its tile), input k (in its group), of a group of 6-bit codes.
inline int code_at6(const uint8_t* group, int i, int k) {
  const int j = k < 16 ? k / 4 : 4 + (k - 16) / 4;
  const int high = (group[256 + (j / 4) * 64 + i * 4 + k % 4] >> (2 * (j % 4))) & 3;
  return code_at<4>(group, i, k) | (high << 4);
}

// Code u of row i, input k, of a group of 5-bit codes.
inline int code_at5(const uint8_t* group, int i, int k) {
  const int j = k < 16 ? k / 4 : 4 + (k - 16) / 4;
  return code_at<4>(group, i, k) | (((group[256 + i * 4 + k % 4] >> j) & 1) << 4);
}

// Code u of row i, input k, of a group of 2-bit codes.
inline int code_at2(const uint8_t* group, int i, int k) {
  const int j = k < 16 ? k / 4 : 4 + (k - 16) / 4;
  return (group[(j / 4) * 64 + i * 4 + k % 4] >> (2 * (j % 4))) & 3;
}

// Code u of row i, input k, of a group of 3-bit codes.
inline int code_at3(const uint8_t* group, int i, int k) {
  const int j = k < 16 ? k / 4 : 4 + (k - 16) / 4;
  return code_at2(group, i, k) | (((group[128 + i * 4 + k % 4] >> j) & 1) << 2);
}

// A group's codes as bytes (load_codes<8>'s w[8]); 2 bits: each plane's 4 vectors shifted
// down; 3 bits: those, then vector t's 3rd bits (bit t of the third plane's bytes) moved to
// bit 2 and added in; 5 bits: the low plane as 4-bit codes, then vector t's 5th bits (bit t
// of the high plane's bytes) moved to bit 4 and added in; 6 bits: the low plane as 4-bit
// codes, then each vector's high bits added in (they do not overlap, so the add is an or).
template <int kBits>
KVSERVE_ALWAYS_INLINE void load_group(const uint8_t* group, V16i* w) {
  if constexpr (kBits == 2 || kBits == 3) {
    const V16i three = v16i_set1(0x03030303);
    for (int p = 0; p < 2; ++p) {
      const V16i plane = v16i_load(group + p * 64);
      for (int t = 0; t < 4; ++t) w[4 * p + t] = (t ? v16i_srli32(plane, 2 * t) : plane) & three;
    }
    if constexpr (kBits == 3) {
      const V16i high = v16i_load(group + 128), bit2 = v16i_set1(0x04040404);
      for (int t = 0; t < 8; ++t) {
        const V16i moved = t < 2 ? v16i_slli32(high, 2 - t) : t > 2 ? v16i_srli32(high, t - 2) : high;
        w[t] = v16i_add(w[t], moved & bit2);
      }
    }
  } else if constexpr (kBits == 5) {
    load_codes<4>(group, w);
    const V16i high = v16i_load(group + 256), bit4 = v16i_set1(0x10101010);
    for (int t = 0; t < 8; ++t) {
      const V16i moved = t < 4 ? v16i_slli32(high, 4 - t) : t > 4 ? v16i_srli32(high, t - 4) : high;
      w[t] = v16i_add(w[t], moved & bit4);
    }
  } else if constexpr (kBits == 6) {
    load_codes<4>(group, w);
    const V16i two = v16i_set1(0x03030303);
    for (int v = 0; v < 2; ++v) {
      const V16i high = v16i_load(group + 256 + v * 64);
      for (int t = 0; t < 4; ++t) w[4 * v + t] = v16i_add(w[4 * v + t], v16i_slli32(v16i_srli32(high, 2 * t) & two, 4));
    }
  } else {
    load_codes<kBits>(group, w);
  }
}

#if defined(KVSERVE_V16_INT8)
// Asks for the codes kPrefetchGroups groups past `group` (the next tile's, past the last of
// this one: a thread's tiles follow each other in memory). On a 2-core EPYC (Zen 4) the
// 1.5B's decode step of 16 sequences took 119.7 / 125.8 / 124.0 ms with it against 134.0 /
// 137.9 / 137.6 without (builds alternating); one sequence's did not move beyond the noise.
// `once`: the call passes over this tile once (all its rows in one pass), so its codes are
// never read again before they leave the caches: they are asked for non-temporally, and a
// weight streamed through does not push the rest of the step (the KV cache, the activations,
// the Python between calls) out of the last-level cache. OLMoE's one-stream step on a Zen 2
// EPYC (AVX2): 28.3-30.2 against 29.9-32.1 ms at a 130-token prompt, 33.9-34.9 against 35.8 at
// 1,200 (one process a build, alternating, each its own repack cache); the 1.5B's one- and
// 16-stream steps and the prompts of both did not move beyond the noise. Passes that read
// a tile again (a prompt's rows, chunk after chunk) keep it in the caches as before.
constexpr int64_t kPrefetchGroups = 16;
template <int64_t kGroupBytes>
KVSERVE_ALWAYS_INLINE void prefetch_ahead(const uint8_t* group, bool once) {
  const uint8_t* ahead = group + kPrefetchGroups * kGroupBytes;
  if (once) {
    for (int64_t b = 0; b < kGroupBytes; b += 64) __builtin_prefetch(ahead + b, 0, 0);
  } else {
    for (int64_t b = 0; b < kGroupBytes; b += 64) __builtin_prefetch(ahead + b, 0, 3);
  }
}
#endif

// What a super-block format (K4, K5, S16, K3, K2) reads: its code width, a scale per 16 inputs
// without an m (S16, K3) or with one (K2), the width its dots run at and the centre of its codes
// (their middle, 2^(bits - 1): K4's 8, K5's 16, S16's 32, K3's 4; K2's minimum takes none).
template <int64_t kFormat>
struct KFormat {
  static constexpr int kBits = a8_code_bits(kFormat);
  static constexpr bool kSym = kFormat == kA8S16 || kFormat == kA8K3;
  static constexpr bool kMin16 = kFormat == kA8K2;
  static constexpr int kDotBits = kBits < 4 ? 4 : kBits;  // (2- and 3-bit codes: the 4-bit pass)
  static constexpr int32_t kCentre = kMin16 ? 0 : 1 << (kBits - 1);
};

#if defined(KVSERVE_V16_INT8)
// Up to R rows of int8 x against one 16-row tile of a K, S16, K3 or K2 format.
template <int64_t kFormat, int R>
KVSERVE_ALWAYS_INLINE void tile_rows_k(float* y, int64_t ys, const QuantizedRows& xq, int64_t r0, int64_t groups,
                                       const uint8_t* codes, const float* scales, int64_t valid, bool once) {
  using F = KFormat<kFormat>;
  constexpr int64_t kGroupBytes = kTile * kGroup * F::kBits / 8;
  constexpr int64_t kRecord = a8_record_floats(kFormat), kInts = a8_record_ints(kFormat);
  // The centre term c qs in integers (exact, as the float one is): no scalar float product
  // and broadcast per row, which took a multiply pipe from the dots.
  constexpr int32_t kCentreInt = F::kCentre;
  V16 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = v16_zero();
  V16 big_d = v16_zero(), big_m = v16_zero();
  const int8_t* sub = nullptr;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t j = g % kSuper;
    if (j == 0) {
      const float* rec = scales + (g / kSuper) * kRecord;
      big_d = v16_load_half(rec);
      if constexpr (!F::kSym) big_m = v16_load_half(rec + 8);
      sub = reinterpret_cast<const int8_t*>(rec + kInts);
    }
    V16i w[8];
    prefetch_ahead<kGroupBytes>(codes + g * kGroupBytes, once);
    load_group<F::kBits>(codes + g * kGroupBytes, w);
    V16 d0, d1, off, m0, m1;
    if constexpr (F::kMin16) {
      const auto* bytes = reinterpret_cast<const uint8_t*>(sub) + 32 * j;
      V16 sc, mn;
      v16_load_nibbles(bytes, sc, mn);
      d0 = big_d * sc;
      m0 = big_m * mn;
      v16_load_nibbles(bytes + 16, sc, mn);
      d1 = big_d * sc;
      m1 = big_m * mn;
    } else if constexpr (F::kSym) {
      d0 = big_d * v16_load_int8(sub + 32 * j);
      d1 = big_d * v16_load_int8(sub + 32 * j + 16);
    } else {
      d0 = big_d * v16_load_int8(sub + 16 * j);
      off = v16_fmadd(v16_set1(static_cast<float>(kCentreInt)), d0, big_m * v16_load_int8(sub + 128 + 16 * j));
    }
    const int64_t first = g * xq.rows + r0;
    const int8_t* qx = xq.q.data() + first * kGroup;
    const float* dx = xq.d.data() + first * 2;
    const int32_t* qs = xq.qs.data() + first * 2;
    const float* sum = xq.sum.data() + first;
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      V16i s0, s1;
      group_dots<F::kDotBits, (R >= kVnniRows)>(s0, s1, w, qx + r * kGroup);
      if constexpr (F::kMin16) {
        const V16 t0 = v16_fmadd(d0, v16_from_int(s0), m0 * v16_set1(static_cast<float>(qs[2 * r])));
        const V16 t1 = v16_fmadd(d1, v16_from_int(s1), m1 * v16_set1(static_cast<float>(qs[2 * r + 1])));
        acc[r] = v16_fmadd(t0, v16_set1(dx[2 * r]), acc[r]);
        acc[r] = v16_fmadd(t1, v16_set1(dx[2 * r + 1]), acc[r]);
        continue;
      }
      const V16 c0 = v16_from_int(v16i_sub(s0, v16i_set1(kCentreInt * qs[2 * r])));
      const V16 c1 = v16_from_int(v16i_sub(s1, v16i_set1(kCentreInt * qs[2 * r + 1])));
      if constexpr (F::kSym) {
        acc[r] = v16_fmadd(d0, c0 * v16_set1(dx[2 * r]), acc[r]);
        acc[r] = v16_fmadd(d1, c1 * v16_set1(dx[2 * r + 1]), acc[r]);
      } else {
        const V16 t = v16_fmadd(c1, v16_set1(dx[2 * r + 1]), c0 * v16_set1(dx[2 * r]));
        acc[r] = v16_fmadd(d0, t, acc[r]);
        acc[r] = v16_fmadd(off, v16_set1(sum[r]), acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) v16_store_n(y + r * ys, acc[r], static_cast<int>(valid));
}
#endif

// The same arithmetic one output at a time (CPUs without the vector code; the tests).
template <int64_t kFormat>
void tile_rows_k_plain(int rows, float* y, int64_t ys, const QuantizedRows& xq, int64_t r0, int64_t groups,
                       const uint8_t* codes, const float* scales, int64_t valid) {
  using F = KFormat<kFormat>;
  constexpr int kBits = F::kBits;
  constexpr int64_t kGroupBytes = kTile * kGroup * kBits / 8;
  constexpr int64_t kRecord = a8_record_floats(kFormat), kInts = a8_record_ints(kFormat);
  constexpr float kCentre = static_cast<float>(F::kCentre);
  for (int r = 0; r < rows; ++r) {
    for (int i = 0; i < valid; ++i) {
      float acc = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t j = g % kSuper, gr = g * xq.rows + r0 + r;
        const float* rec = scales + (g / kSuper) * kRecord;
        const auto* big = reinterpret_cast<const c10::Half*>(rec);  // D[16], then K's and K2's M[16]
        const auto* sub = reinterpret_cast<const int8_t*>(rec + kInts);
        int32_t dots[2];
        float c[2];
        for (int h = 0; h < 2; ++h) {
          int32_t dot = 0;
          for (int k = 16 * h; k < 16 * h + 16; ++k) {
            const uint8_t* group = codes + g * kGroupBytes;
            const int u = kBits == 6   ? code_at6(group, i, k)
                          : kBits == 5 ? code_at5(group, i, k)
                          : kBits == 3 ? code_at3(group, i, k)
                          : kBits == 2 ? code_at2(group, i, k)
                                       : code_at<kBits>(group, i, k);
            dot += u * xq.q[gr * kGroup + k];
          }
          dots[h] = dot;
          c[h] = static_cast<float>(dot) - kCentre * static_cast<float>(xq.qs[2 * gr + h]);
        }
        if constexpr (F::kMin16) {
          const auto* bytes = reinterpret_cast<const uint8_t*>(sub) + 32 * j;
          for (int h = 0; h < 2; ++h) {
            const float d = static_cast<float>(big[i]) * static_cast<float>(bytes[16 * h + i] & 0xF);
            const float m = static_cast<float>(big[16 + i]) * static_cast<float>(bytes[16 * h + i] >> 4);
            const float t = std::fma(d, static_cast<float>(dots[h]), m * static_cast<float>(xq.qs[2 * gr + h]));
            acc = std::fma(t, xq.d[2 * gr + h], acc);
          }
        } else if constexpr (F::kSym) {
          const float d0 = static_cast<float>(big[i]) * static_cast<float>(sub[32 * j + i]);
          const float d1 = static_cast<float>(big[i]) * static_cast<float>(sub[32 * j + 16 + i]);
          const float p0 = c[0] * xq.d[2 * gr], p1 = c[1] * xq.d[2 * gr + 1];
          acc = std::fma(d0, p0, acc);
          acc = std::fma(d1, p1, acc);
        } else {
          const float d = static_cast<float>(big[i]) * static_cast<float>(sub[16 * j + i]);
          const float m = static_cast<float>(big[16 + i]) * static_cast<float>(sub[128 + 16 * j + i]);
          const float off = std::fma(kCentre, d, m);
          const float p0 = c[0] * xq.d[2 * gr];
          const float t = std::fma(c[1], xq.d[2 * gr + 1], p0);
          acc = std::fma(d, t, acc);
          acc = std::fma(off, xq.sum[gr], acc);
        }
      }
      y[r * ys + i] = acc;
    }
  }
}

// The centre c an L4 format's table values are moved by to bytes u = value + c: MXFP4's doubled
// values (-12..12) as u < 32, so that the dots without VNNI run them as 5-bit codes (one pass
// of byte multiply-adds, where 8-bit codes take two); IQ4's (-127..113) by 128.
constexpr int32_t lut_centre(int64_t format) { return format == kA8MX4 ? 16 : 128; }

// The 16 table values of an L4 format as bytes u = value + lut_centre.
struct Lut16 {
  alignas(16) uint8_t u[16];
};

Lut16 lut_of(int64_t format) {
  const int8_t* values = a8_table(format);
  Lut16 t;
  for (int i = 0; i < 16; ++i) t.u[i] = static_cast<uint8_t>(values[i] + lut_centre(format));
  return t;
}

// What a d-per-32 format (L4: table indices; D: symmetric codes; A: with an m) reads: its code
// width, the centre c of its bytes u, whether they are table indices, whether d is float16.
template <int64_t kFormat>
struct DFormat {
  static constexpr bool kLut = kFormat == kA8MX4 || kFormat == kA8NL4 || kFormat == kA8NX4;
  static constexpr bool kSuperScales = kFormat == kA8NX4;  // (d = D sc per super-block: a8_record_floats)
  static constexpr bool kAffine = kFormat == kA8A4 || kFormat == kA8A5;  // (an m per group too)
  static constexpr int kBits = a8_code_bits(kFormat);
  static constexpr int32_t kCentre = kLut ? lut_centre(kFormat) : kFormat == kA8D8 ? 128 : kBits == 5 ? 16 : 8;
  // The bits of its bytes u (group_dots' pass): an L4 format's lie below twice its centre
  static constexpr int kDotBits = kLut ? (kCentre == 16 ? 5 : 8) : kBits;
  static constexpr bool kHalf = a8_float16_scales(kFormat);
  static constexpr bool kE8M0 = kFormat == kA8MX4;
};

// MX4's d from its E8M0 byte: 2^(e - 128) (v16_load_e8m0_half's; e = 0: 0, see a8_fits).
inline float e8m0_d(uint8_t e) { return e ? std::ldexp(1.0f, static_cast<int>(e) - 128) : 0.0f; }

#if defined(KVSERVE_V16_INT8) && defined(KVSERVE_V16_LUT)
// Up to R rows of int8 x against one 16-row tile of an L4, D or A format.
template <int64_t kFormat, int R>
KVSERVE_ALWAYS_INLINE void tile_rows_d(float* y, int64_t ys, const QuantizedRows& xq, int64_t r0, int64_t groups,
                                       const uint8_t* codes, const float* scales, int64_t valid, const Lut16& lut,
                                       bool once) {
  using F = DFormat<kFormat>;
  constexpr int64_t kGroupBytes = kTile * kGroup * F::kBits / 8;
  V16i table = v16i_zero();
  if constexpr (F::kLut) table = v16i_bcast16(lut.u);
  V16 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = v16_zero();
  for (int64_t g = 0; g < groups; ++g) {
    V16i w[8];
    prefetch_ahead<kGroupBytes>(codes + g * kGroupBytes, once);
    load_group<F::kBits>(codes + g * kGroupBytes, w);
    if constexpr (F::kLut) {
      for (int j = 0; j < 8; ++j) w[j] = v16i_lut16(table, w[j]);
    }
    V16 d, off = v16_zero();
    const auto* halves = reinterpret_cast<const uint16_t*>(scales) + g * (F::kAffine ? 32 : 16);
    if constexpr (F::kSuperScales) {
      const float* rec = scales + (g / kSuper) * a8_record_floats(kFormat);
      d = v16_load_half(rec) * v16_load_int8(reinterpret_cast<const int8_t*>(rec + a8_record_ints(kFormat)) +
                                             16 * (g % kSuper));
    } else if constexpr (F::kHalf) {
      d = v16_load_half(halves);
    } else {
      static_assert(F::kE8M0, "a d-per-32 format's scales are float16, E8M0 bytes or a super-block's");
      d = v16_load_e8m0_half(reinterpret_cast<const uint8_t*>(scales) + g * 16);
    }
    if constexpr (F::kAffine) off = v16_fmadd(v16_set1(static_cast<float>(F::kCentre)), d, v16_load_half(halves + 16));
    const int64_t first = g * xq.rows + r0;
    const int8_t* qx = xq.q.data() + first * kGroup;
    const float* dx = xq.d.data() + first * 2;
    const int32_t* qs = xq.qs.data() + first * 2;
    const float* sum = xq.sum.data() + first;
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      V16i s0, s1;
      group_dots<F::kDotBits, (R >= kVnniRows)>(s0, s1, w, qx + r * kGroup);
      const V16 c0 = v16_from_int(v16i_sub(s0, v16i_set1(F::kCentre * qs[2 * r])));
      const V16 c1 = v16_from_int(v16i_sub(s1, v16i_set1(F::kCentre * qs[2 * r + 1])));
      const V16 t = v16_fmadd(c1, v16_set1(dx[2 * r + 1]), c0 * v16_set1(dx[2 * r]));
      acc[r] = v16_fmadd(d, t, acc[r]);
      if constexpr (F::kAffine) acc[r] = v16_fmadd(off, v16_set1(sum[r]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) v16_store_n(y + r * ys, acc[r], static_cast<int>(valid));
}
#endif

// The same arithmetic one output at a time.
template <int64_t kFormat>
void tile_rows_d_plain(int rows, float* y, int64_t ys, const QuantizedRows& xq, int64_t r0, int64_t groups,
                       const uint8_t* codes, const float* scales, int64_t valid, const Lut16& lut) {
  using F = DFormat<kFormat>;
  constexpr int64_t kGroupBytes = kTile * kGroup * F::kBits / 8;
  for (int r = 0; r < rows; ++r) {
    for (int i = 0; i < valid; ++i) {
      float acc = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t gr = g * xq.rows + r0 + r;
        float c[2];
        for (int h = 0; h < 2; ++h) {
          int32_t dot = 0;
          for (int k = 16 * h; k < 16 * h + 16; ++k) {
            const uint8_t* group = codes + g * kGroupBytes;
            const int u = F::kBits == 5 ? code_at5(group, i, k) : code_at<F::kBits>(group, i, k);
            dot += (F::kLut ? lut.u[u] : u) * xq.q[gr * kGroup + k];
          }
          c[h] = static_cast<float>(dot) - static_cast<float>(F::kCentre) * static_cast<float>(xq.qs[2 * gr + h]);
        }
        const auto* halves = reinterpret_cast<const c10::Half*>(scales) + g * (F::kAffine ? 32 : 16);
        const float* rec = F::kSuperScales ? scales + (g / kSuper) * a8_record_floats(kFormat) : nullptr;
        const float d = rec        ? static_cast<float>(reinterpret_cast<const c10::Half*>(rec)[i]) *
                                         static_cast<float>(reinterpret_cast<const int8_t*>(
                                             rec + a8_record_ints(kFormat))[16 * (g % kSuper) + i])
                        : F::kHalf ? static_cast<float>(halves[i])
                                   : e8m0_d(reinterpret_cast<const uint8_t*>(scales)[g * 16 + i]);
        const float p0 = c[0] * xq.d[2 * gr];
        const float t = std::fma(c[1], xq.d[2 * gr + 1], p0);
        acc = std::fma(d, t, acc);
        if constexpr (F::kAffine) {
          const float off = std::fma(static_cast<float>(F::kCentre), d, static_cast<float>(halves[16 + i]));
          acc = std::fma(off, xq.sum[gr], acc);
        }
      }
      y[r * ys + i] = acc;
    }
  }
}

}  // namespace

A8Segment a8_segment(size_t i, const at::Tensor& codes, const at::Tensor& scales, int64_t format, int64_t groups) {
  const bool affine = format == kA8A4 || format == kA8A5, half = a8_float16_scales(format);
  TORCH_CHECK(format >= kA8A4 && format <= kA8Last, "segment ", i, ": format ", format, " is not an A8Format");
  TORCH_CHECK(codes.is_contiguous() && codes.scalar_type() == at::kByte && codes.dim() == 4 &&
                  codes.size(1) == groups, "segment ", i, ": codes must be uint8 [tiles, K/32, ., 64]");
  const int64_t bits = a8_code_bits(format);
  TORCH_CHECK(codes.size(2) == bits && codes.size(3) == 64, "segment ", i, ": codes of the wrong width");
  const int64_t tiles = codes.size(0);
  if (half) {  // (float16 d's, and A's m's: a tile's are groups * 8 or 16 floats' bytes from the last's)
    const int64_t per_group = (affine ? 2 : 1) * kTile;
    TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kHalf &&
                    scales.numel() == tiles * groups * per_group,
                "segment ", i, ": scales must be float16 [tiles, K/32, ", affine ? "2, 16]" : "16]");
    return A8Segment{format, codes.data_ptr<uint8_t>(), static_cast<const float*>(scales.data_ptr()), tiles,
                     groups * kTile * kGroup * bits / 8, groups * per_group / 2};
  }
  if (format == kA8MX4) {  // (E8M0 bytes: a tile's are groups * 4 floats' bytes from the last's)
    TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kByte &&
                    scales.numel() == tiles * groups * kTile,
                "segment ", i, ": scales must be uint8 [tiles, K/32, 16]");
    return A8Segment{format, codes.data_ptr<uint8_t>(), static_cast<const float*>(scales.data_ptr()), tiles,
                     groups * kTile * kGroup * bits / 8, groups * kTile / 4};
  }
  TORCH_CHECK(groups % kSuper == 0, "K must be whole super-blocks of 256");
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == at::kFloat &&
                  scales.numel() == tiles * (groups / kSuper) * a8_record_floats(format),
              "segment ", i, ": scales must be float32 [tiles, K/256, ", a8_record_floats(format), "]");
  return A8Segment{format, codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), tiles,
                   groups * kTile * kGroup * bits / 8, (groups / kSuper) * a8_record_floats(format)};
}

std::vector<at::Tensor> a8_empty(int64_t format, int64_t tiles, int64_t groups) {
  TORCH_CHECK(format >= kA8A4 && format <= kA8Last, "format ", format, " is not an A8Format");
  at::Tensor codes = at::empty({tiles, groups, a8_code_bits(format), 64}, at::kByte), scales;
  if (a8_float16_scales(format)) {
    scales = format == kA8A4 || format == kA8A5 ? at::empty({tiles, groups, 2, kTile}, at::kHalf)
                                                : at::empty({tiles, groups, kTile}, at::kHalf);
  } else if (format == kA8MX4) {
    scales = at::empty({tiles, groups, kTile}, at::kByte);
  } else {
    TORCH_CHECK(groups % kSuper == 0, "K must be whole super-blocks of 256");
    scales = at::empty({tiles, groups / kSuper, a8_record_floats(format)}, at::kFloat);
  }
  return {codes, scales};
}

namespace {

// Rows of x against tile t of a segment in format kFormat: a8_tile's work, the format fixed.
template <int64_t kFormat>
KVSERVE_ALWAYS_INLINE void tile_as(const A8Segment& seg, int64_t t, float* y, int64_t ys, const QuantizedRows& xq,
                                   int64_t r0, int rows, int64_t groups, int64_t valid, bool plain, bool once) {
  const uint8_t* c = seg.codes + t * seg.code_bytes;
  const float* s = seg.scales + t * seg.scale_floats;
  if constexpr (kFormat != kA8K4 && kFormat != kA8K5 && kFormat != kA8S16 && kFormat != kA8K2 &&
                kFormat != kA8K3) {  // (L4, D, A)
    Lut16 lut{};
    if constexpr (DFormat<kFormat>::kLut) lut = lut_of(kFormat);
#if defined(KVSERVE_V16_INT8) && defined(KVSERVE_V16_LUT)
    if (!plain) {
      return with_rows<kRowsInt8>(rows, [&](auto n) {
        tile_rows_d<kFormat, decltype(n)::value>(y, ys, xq, r0, groups, c, s, valid, lut, once);
      });
    }
#endif
    tile_rows_d_plain<kFormat>(rows, y, ys, xq, r0, groups, c, s, valid, lut);
  } else {
#if defined(KVSERVE_V16_INT8)
    if (!plain) {
      return with_rows<kRowsInt8>(rows, [&](auto n) {
        tile_rows_k<kFormat, decltype(n)::value>(y, ys, xq, r0, groups, c, s, valid, once);
      });
    }
#endif
    tile_rows_k_plain<kFormat>(rows, y, ys, xq, r0, groups, c, s, valid);
  }
}

// f(std::integral_constant<int64_t, format>) for a checked segment's format.
template <typename F>
void with_format(int64_t format, F&& f) {
  switch (format) {
    case kA8A4: return f(std::integral_constant<int64_t, kA8A4>{});
    case kA8A5: return f(std::integral_constant<int64_t, kA8A5>{});
    case kA8K4: return f(std::integral_constant<int64_t, kA8K4>{});
    case kA8K5: return f(std::integral_constant<int64_t, kA8K5>{});
    case kA8S16: return f(std::integral_constant<int64_t, kA8S16>{});
    case kA8K2: return f(std::integral_constant<int64_t, kA8K2>{});
    case kA8K3: return f(std::integral_constant<int64_t, kA8K3>{});
    case kA8MX4: return f(std::integral_constant<int64_t, kA8MX4>{});
    case kA8D4: return f(std::integral_constant<int64_t, kA8D4>{});
    case kA8D5: return f(std::integral_constant<int64_t, kA8D5>{});
    case kA8D8: return f(std::integral_constant<int64_t, kA8D8>{});
    case kA8NL4: return f(std::integral_constant<int64_t, kA8NL4>{});
    default: return f(std::integral_constant<int64_t, kA8NX4>{});
  }
}

// y = x's rows against a segment, tile by tile over the threads (grouped_rows.h's walk), the
// format chosen once (a8_tile chooses it per tile: about 1% of a one-row GEMV here).
void run_segment(at::Tensor& y, const QuantizedRows& xq, const A8Segment& seg, int64_t groups, bool plain) {
  const int64_t ys = y.stride(0);
  float* yp = y.data_ptr<float>();
  const bool once = y.size(0) <= kRowsInt8;
  with_format(seg.format, [&](auto format) {
    for_each_tile_chunk(y.size(0), kRowsInt8, seg.tiles, y.size(1), [&](int64_t t, int64_t r0, int r, int64_t valid) {
      tile_as<decltype(format)::value>(seg, t, yp + r0 * ys + t * kTile, ys, xq, r0, r, groups, valid, plain, once);
    });
  });
}

}  // namespace

void a8_tile(const A8Segment& seg, int64_t t, float* y, int64_t ys, const QuantizedRows& xq, int64_t r0, int rows,
             int64_t groups, int64_t valid, bool plain, bool once) {
  with_format(seg.format, [&](auto format) {
    tile_as<decltype(format)::value>(seg, t, y, ys, xq, r0, rows, groups, valid, plain, once);
  });
}

void gguf_a8_linear(at::Tensor& out, const at::Tensor& x, const std::vector<at::Tensor>& parts,
                    const std::vector<int64_t>& formats, bool plain) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat, "x must be float32 [M, K]");
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.scalar_type() == at::kFloat && out.size(0) == x.size(0),
              "out must be float32 [M, N]");
  TORCH_CHECK(parts.size() == 2 * formats.size() && !formats.empty(), "one (codes, scales) pair per format");
  const int64_t k = x.size(1), groups = k / kGroup, n = out.size(1);
  std::vector<A8Segment> segs;
  std::vector<int64_t> starts;  // each segment's first output row
  int64_t start = 0;
  for (size_t i = 0; i < formats.size(); ++i) {
    // (a8_segment checks the format, the codes and the scales, as A8Experts' segments are checked)
    segs.push_back(a8_segment(i, parts[2 * i], parts[2 * i + 1], formats[i], groups));
    const int64_t rows = std::min(segs.back().tiles * kTile, n - start);
    TORCH_CHECK(rows > 0, "segments hold more rows than out");
    starts.push_back(start);
    start += rows;
  }
  TORCH_CHECK(start == n, "segments hold ", start, " rows, out has ", n);
  const QuantizedRows xq = quantize_rows(x.data_ptr<float>(), x.size(0), x.stride(0), groups, 0.0f, x.size(0));
  // Where every segment starts on a tile (models/gguf_linear.py plan_segments makes them so),
  // output tile t is one segment's tile and all segments' tiles go out to the threads
  // together: one fork and one wait a projection, not one a segment (q and k, then v).
  const bool on_tiles = std::all_of(starts.begin(), starts.end(), [](int64_t s) { return s % kTile == 0; });
  if (segs.size() == 1 || !on_tiles) {
    for (size_t i = 0; i < segs.size(); ++i) {
      at::Tensor y = out.narrow(1, starts[i], (i + 1 < segs.size() ? starts[i + 1] : n) - starts[i]);
      run_segment(y, xq, segs[i], groups, plain);
    }
    return;
  }
  const int64_t ys = out.stride(0), tiles = (n + kTile - 1) / kTile;
  float* yp = out.data_ptr<float>();
  const bool once = out.size(0) <= kRowsInt8;
  for_each_tile_chunk(out.size(0), kRowsInt8, tiles, n, [&](int64_t t, int64_t r0, int r, int64_t valid) {
    size_t i = 0;
    while (i + 1 < segs.size() && t * kTile >= starts[i + 1]) ++i;
    a8_tile(segs[i], t - starts[i] / kTile, yp + r0 * ys + t * kTile, ys, xq, r0, r, groups, valid, plain, once);
  });
}

}  // namespace kvserve

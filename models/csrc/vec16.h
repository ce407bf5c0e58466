// V16: 16 float32 lanes, the vector every kernel computes with. One __m512 on
// AVX-512, two __m256 (lanes 0-7, 8-15) on AVX2 + FMA + F16C.
//
// The width is fixed at 16 on both so that a kernel is written once and its
// arithmetic is the same on both: every lane-wise operation (add, mul, FMA,
// conversions) rounds the same per lane, and the reductions here (reduce_add,
// sum16) spell out one tree of pairwise adds on either ISA. So an AVX2 build
// computes what the AVX-512 build computes, bit for bit (tests/models/
// test_cpu_isa.py holds it so), and a server gives the same answer on every
// x86 CPU it runs on.
//
// KVSERVE_V16 is defined where V16 exists; kernels keep a plain C++ path for
// the other CPUs.
#pragma once

#include <algorithm>
#include <cstdint>

// For the small helpers inside the GEMMs' inner loops, whose vector arguments
// must stay in registers. GCC weighs inlining against the size of the
// translation unit: once the kernels stopped including all of torch's headers
// (84a3546), their units were small enough that it left load_codes and
// group_dots out of line, passed their V16i arrays through memory once per
// group and row, and w4a8's VNNI GEMM ran 2-2.5x slower (bench.step on
// SmolLM2's projections, 64 rows: 29.5 -> 58-64 ms).
#define KVSERVE_ALWAYS_INLINE inline __attribute__((always_inline))

// KVSERVE_FORCE_V16_AVX2 builds the AVX2 kernels where AVX-512 is enabled:
// the AVX-VNNI kernels' test build (models/ops/isa.py, KVSERVE_CPU_ISA=avx2-vnni on
// a CPU with AVX512-VNNI but not AVX-VNNI) needs AVX512-VL for vpdpbusd on
// 256 bits.
#if defined(__AVX512F__) && !defined(KVSERVE_FORCE_V16_AVX2)
#define KVSERVE_V16 1
#define KVSERVE_V16_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVSERVE_V16 1
#define KVSERVE_V16_AVX2 1
#include <immintrin.h>
#endif

// KVSERVE_V16_INT8: byte dot products exist (AVX512-VNNI, AVX512-BW or AVX2).
#if defined(KVSERVE_V16_AVX2) || (defined(KVSERVE_V16_AVX512) && (defined(__AVX512VNNI__) || defined(__AVX512BW__)))
#define KVSERVE_V16_INT8 1
#endif

// KVSERVE_V16_VNNI: vpdpbusd on V16i. AVX-512: AVX512-VNNI. AVX2: AVX-VNNI
// (Alder Lake, Sierra Forest, Zen 5: the VEX form), or the EVEX form of
// AVX512-VNNI + VL in the forced AVX2 build.
#if (defined(KVSERVE_V16_AVX512) && defined(__AVX512VNNI__)) || \
    (defined(KVSERVE_V16_AVX2) && (defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__))))
#define KVSERVE_V16_VNNI 1
#endif

#if defined(KVSERVE_V16)
namespace kvserve {

// The instruction set V16 runs on, for logs and tests.
inline constexpr const char* kV16Isa =
#if defined(KVSERVE_V16_AVX512)
    "avx512";
#else
    "avx2";
#endif

#if defined(KVSERVE_V16_AVX512)
struct V16 {
  __m512 v;
};
// 16 int32 lanes, for codes on their way to float.
struct V16i {
  __m512i v;
};

inline V16 v16_zero() { return {_mm512_setzero_ps()}; }
inline V16 v16_set1(float x) { return {_mm512_set1_ps(x)}; }
inline V16 v16_load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void v16_store(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
// Lanes [0, n) from p, the others zero; nothing past p + n is read.
inline V16 v16_load_n(const float* p, int n) { return {_mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p)}; }
// Lanes [0, n) to p; nothing past p + n is written.
inline void v16_store_n(float* p, V16 a, int n) { _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), a.v); }
// Lanes [0, n) of a, the others zero.
inline V16 v16_first_n(V16 a, int n) { return {_mm512_maskz_mov_ps(static_cast<__mmask16>((1u << n) - 1), a.v)}; }
inline V16 operator+(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 operator-(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline V16 operator*(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V16 v16_max(V16 a, V16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline V16 v16_min(V16 a, V16 b) { return {_mm512_min_ps(a.v, b.v)}; }
inline V16 v16_abs(V16 a) { return {_mm512_abs_ps(a.v)}; }
// a * b + c, rounded once.
inline V16 v16_fmadd(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
// num / a where a > 0, else 0.
inline V16 v16_div_where_positive(float num, V16 a) {
  const __mmask16 pos = _mm512_cmp_ps_mask(a.v, _mm512_setzero_ps(), _CMP_GT_OQ);
  return {_mm512_maskz_div_ps(pos, _mm512_set1_ps(num), a.v)};
}
inline V16 v16_div(V16 a, V16 b) { return {_mm512_div_ps(a.v, b.v)}; }
// floor(a)
inline V16 v16_floor(V16 a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)}; }

inline V16i v16i_load(const void* p) { return {_mm512_loadu_si512(p)}; }
inline V16i v16i_set1(int32_t x) { return {_mm512_set1_epi32(x)}; }
inline V16i operator&(V16i a, V16i b) { return {_mm512_and_si512(a.v, b.v)}; }
inline V16i v16i_srli32(V16i a, int n) { return {_mm512_srli_epi32(a.v, n)}; }
inline V16i v16i_srli16(V16i a, int n) { return {_mm512_srli_epi16(a.v, n)}; }
inline V16i v16i_add(V16i a, V16i b) { return {_mm512_add_epi32(a.v, b.v)}; }
inline V16i v16i_sub(V16i a, V16i b) { return {_mm512_sub_epi32(a.v, b.v)}; }
inline V16i v16i_slli32(V16i a, int n) { return {_mm512_slli_epi32(a.v, n)}; }
inline V16i v16i_zero() { return {_mm512_setzero_si512()}; }
// The 4 bytes at p in every 32-bit lane.
inline V16i v16i_bcast4(const int8_t* p) {
  int32_t w;
  __builtin_memcpy(&w, p, 4);
  return {_mm512_set1_epi32(w)};
}
#if defined(KVSERVE_V16_VNNI)
// s += per 32-bit lane the dot of u's 4 unsigned bytes with the 4 signed bytes
// at p (vpdpbusd), the bytes broadcast from memory by the instruction itself
// (GCC emits a separate vpbroadcastd for _mm512_set1_epi32).
inline void v16i_dpbusd_bcast4(V16i& s, V16i u, const int8_t* p) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(s.v) : "v"(u.v), "m"(*reinterpret_cast<const int32_t*>(p)));
}
#endif
#if defined(__AVX512BW__)
// Per 16-bit lane u0 x0 + u1 x1 of its two bytes, u's unsigned, x's signed,
// saturated to int16 (exact where u <= 127: 2 * 127 * 128 fits).
inline V16i v16i_maddubs(V16i u, V16i x) { return {_mm512_maddubs_epi16(u.v, x.v)}; }
inline V16i v16i_add16(V16i a, V16i b) { return {_mm512_add_epi16(a.v, b.v)}; }
// Per 32-bit lane the sum of its two int16 lanes.
inline V16i v16i_widen_pairs(V16i a) { return {_mm512_madd_epi16(a.v, _mm512_set1_epi16(1))}; }
#define KVSERVE_V16_LUT 1
// Each byte of idx (0..15) looked up in the 16 bytes of its 128-bit lane of table (vpshufb).
inline V16i v16i_lut16(V16i table, V16i idx) { return {_mm512_shuffle_epi8(table.v, idx.v)}; }
// The 16 bytes at p in every 128-bit lane.
inline V16i v16i_bcast16(const void* p) {
  return {_mm512_broadcast_i32x4(_mm_loadu_si128(static_cast<const __m128i*>(p)))};
}
#endif
inline V16 v16_from_int(V16i a) { return {_mm512_cvtepi32_ps(a.v)}; }
inline V16 v16_as_float(V16i a) { return {_mm512_castsi512_ps(a.v)}; }
// Round to the nearest integer, ties to even (the current rounding mode).
inline V16i v16_round_to_int(V16 a) { return {_mm512_cvtps_epi32(a.v)}; }
// The lanes, saturated to int8, to 16 bytes at p.
inline void v16i_store_int8(int8_t* p, V16i a) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtsepi32_epi8(a.v));
}

// 16 values of float16, bfloat16 or int8 as float32 (exact conversions).
inline V16 v16_load_half(const void* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline V16 v16_load_bf16(const void* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
}
inline V16 v16_load_int8(const int8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
// 16 E8M0 exponents e (MXFP4's scales) as 2^(e - 128): the float of exponent field e, halved
// (exact, subnormal 2^-127 included); e = 0 gives 0, not 2^-128.
inline V16 v16_load_e8m0_half(const uint8_t* p) {
  const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return {_mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(e, 23)), _mm512_set1_ps(0.5f))};
}
// 16 bytes' low and high nibbles as floats (Q2_K's scale | min << 4 bytes).
inline void v16_load_nibbles(const uint8_t* p, V16& lo, V16& hi) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = {_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0xF)))};
  hi = {_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4))};
}

// The 128-bit-lane shuffles of reduce16, named by what they do on 16 lanes:
// per 128-bit lane, as _mm_unpacklo_ps / _mm_unpackhi_ps / _mm_shuffle_ps.
inline V16 v16_unpacklo(V16 a, V16 b) { return {_mm512_unpacklo_ps(a.v, b.v)}; }
inline V16 v16_unpackhi(V16 a, V16 b) { return {_mm512_unpackhi_ps(a.v, b.v)}; }
template <int imm>
inline V16 v16_shuffle(V16 a, V16 b) { return {_mm512_shuffle_ps(a.v, b.v, imm)}; }
// 128-bit lanes [a0, a2, b0, b2] and [a1, a3, b1, b3].
inline V16 v16_even_quarters(V16 a, V16 b) { return {_mm512_shuffle_f32x4(a.v, b.v, _MM_SHUFFLE(2, 0, 2, 0))}; }
inline V16 v16_odd_quarters(V16 a, V16 b) { return {_mm512_shuffle_f32x4(a.v, b.v, _MM_SHUFFLE(3, 1, 3, 1))}; }
// Lanes 0-7 + lanes 8-15, as 8 lanes.
inline __m256 v16_fold(V16 a) {
  return _mm256_add_ps(_mm512_castps512_ps256(a.v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1)));
}
inline __m256 v16_fold_max(V16 a) {
  return _mm256_max_ps(_mm512_castps512_ps256(a.v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1)));
}

#else  // AVX2

struct V16 {
  __m256 lo, hi;
};
struct V16i {
  __m256i lo, hi;
};

// The mask of lanes [0, n) of a half starting at lane `first`.
inline __m256i v16_half_mask(int first, int n) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n - first), idx);
}

inline V16 v16_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 v16_set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V16 v16_load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void v16_store(float* p, V16 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline V16 v16_load_n(const float* p, int n) {
  return {_mm256_maskload_ps(p, v16_half_mask(0, n)), _mm256_maskload_ps(p + 8, v16_half_mask(8, n))};
}
inline void v16_store_n(float* p, V16 a, int n) {
  _mm256_maskstore_ps(p, v16_half_mask(0, n), a.lo);
  _mm256_maskstore_ps(p + 8, v16_half_mask(8, n), a.hi);
}
inline V16 v16_first_n(V16 a, int n) {
  return {_mm256_and_ps(a.lo, _mm256_castsi256_ps(v16_half_mask(0, n))),
          _mm256_and_ps(a.hi, _mm256_castsi256_ps(v16_half_mask(8, n)))};
}
inline V16 operator+(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 operator-(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V16 operator*(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 v16_max(V16 a, V16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline V16 v16_min(V16 a, V16 b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline V16 v16_abs(V16 a) {
  const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  return {_mm256_and_ps(a.lo, m), _mm256_and_ps(a.hi, m)};
}
inline V16 v16_fmadd(V16 a, V16 b, V16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline V16 v16_div_where_positive(float num, V16 a) {
  const __m256 z = _mm256_setzero_ps(), n = _mm256_set1_ps(num);
  return {_mm256_and_ps(_mm256_cmp_ps(a.lo, z, _CMP_GT_OQ), _mm256_div_ps(n, a.lo)),
          _mm256_and_ps(_mm256_cmp_ps(a.hi, z, _CMP_GT_OQ), _mm256_div_ps(n, a.hi))};
}
inline V16 v16_div(V16 a, V16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline V16 v16_floor(V16 a) { return {_mm256_floor_ps(a.lo), _mm256_floor_ps(a.hi)}; }

inline V16i v16i_load(const void* p) {
  const __m256i* q = static_cast<const __m256i*>(p);
  return {_mm256_loadu_si256(q), _mm256_loadu_si256(q + 1)};
}
inline V16i v16i_set1(int32_t x) { return {_mm256_set1_epi32(x), _mm256_set1_epi32(x)}; }
inline V16i operator&(V16i a, V16i b) { return {_mm256_and_si256(a.lo, b.lo), _mm256_and_si256(a.hi, b.hi)}; }
inline V16i v16i_srli32(V16i a, int n) { return {_mm256_srli_epi32(a.lo, n), _mm256_srli_epi32(a.hi, n)}; }
inline V16i v16i_srli16(V16i a, int n) { return {_mm256_srli_epi16(a.lo, n), _mm256_srli_epi16(a.hi, n)}; }
inline V16i v16i_add(V16i a, V16i b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
inline V16i v16i_sub(V16i a, V16i b) { return {_mm256_sub_epi32(a.lo, b.lo), _mm256_sub_epi32(a.hi, b.hi)}; }
inline V16i v16i_slli32(V16i a, int n) { return {_mm256_slli_epi32(a.lo, n), _mm256_slli_epi32(a.hi, n)}; }
inline V16i v16i_zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline V16i v16i_bcast4(const int8_t* p) {
  int32_t w;
  __builtin_memcpy(&w, p, 4);
  const __m256i v = _mm256_set1_epi32(w);
  return {v, v};
}
inline V16i v16i_maddubs(V16i u, V16i x) {
  return {_mm256_maddubs_epi16(u.lo, x.lo), _mm256_maddubs_epi16(u.hi, x.hi)};
}
inline V16i v16i_add16(V16i a, V16i b) { return {_mm256_add_epi16(a.lo, b.lo), _mm256_add_epi16(a.hi, b.hi)}; }
inline V16i v16i_widen_pairs(V16i a) {
  const __m256i ones = _mm256_set1_epi16(1);
  return {_mm256_madd_epi16(a.lo, ones), _mm256_madd_epi16(a.hi, ones)};
}
#define KVSERVE_V16_LUT 1
inline V16i v16i_lut16(V16i table, V16i idx) {
  return {_mm256_shuffle_epi8(table.lo, idx.lo), _mm256_shuffle_epi8(table.hi, idx.hi)};
}
inline V16i v16i_bcast16(const void* p) {
  const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128(static_cast<const __m128i*>(p)));
  return {v, v};
}
#if defined(KVSERVE_V16_VNNI)
// s += per 32-bit lane the dot of u's 4 unsigned bytes with the 4 signed bytes at p (vpdpbusd).
inline void v16i_dpbusd_bcast4(V16i& s, V16i u, const int8_t* p) {
  const V16i x = v16i_bcast4(p);
#if defined(__AVXVNNI__)
  s = {_mm256_dpbusd_avx_epi32(s.lo, u.lo, x.lo), _mm256_dpbusd_avx_epi32(s.hi, u.hi, x.hi)};
#else
  s = {_mm256_dpbusd_epi32(s.lo, u.lo, x.lo), _mm256_dpbusd_epi32(s.hi, u.hi, x.hi)};
#endif
}
#endif
inline V16 v16_from_int(V16i a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
inline V16 v16_as_float(V16i a) { return {_mm256_castsi256_ps(a.lo), _mm256_castsi256_ps(a.hi)}; }
inline V16i v16_round_to_int(V16 a) { return {_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi)}; }
inline void v16i_store_int8(int8_t* p, V16i a) {
  // int32 -> int16 -> int8, saturating, as vpmovsdb; the packs work per 128-bit lane.
  const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(a.lo, a.hi), _MM_SHUFFLE(3, 1, 2, 0));
  const __m128i b = _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), b);
}

inline V16 v16_load_half(const void* p) {
  const __m128i* q = static_cast<const __m128i*>(p);
  return {_mm256_cvtph_ps(_mm_loadu_si128(q)), _mm256_cvtph_ps(_mm_loadu_si128(q + 1))};
}
inline V16 v16_load_bf16(const void* p) {
  const __m128i* q = static_cast<const __m128i*>(p);
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(q)), 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(q + 1)), 16))};
}
inline V16 v16_load_int8(const int8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
}
inline V16 v16_load_e8m0_half(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256 half = _mm256_set1_ps(0.5f);
  const auto scale = [&](__m128i bytes) {
    return _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu8_epi32(bytes), 23)), half);
  };
  return {scale(b), scale(_mm_srli_si128(b, 8))};
}
inline void v16_load_nibbles(const uint8_t* p, V16& lo, V16& hi) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i b0 = _mm256_cvtepu8_epi32(b), b1 = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)), f = _mm256_set1_epi32(0xF);
  lo = {_mm256_cvtepi32_ps(_mm256_and_si256(b0, f)), _mm256_cvtepi32_ps(_mm256_and_si256(b1, f))};
  hi = {_mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4))};
}

inline V16 v16_unpacklo(V16 a, V16 b) { return {_mm256_unpacklo_ps(a.lo, b.lo), _mm256_unpacklo_ps(a.hi, b.hi)}; }
inline V16 v16_unpackhi(V16 a, V16 b) { return {_mm256_unpackhi_ps(a.lo, b.lo), _mm256_unpackhi_ps(a.hi, b.hi)}; }
template <int imm>
inline V16 v16_shuffle(V16 a, V16 b) { return {_mm256_shuffle_ps(a.lo, b.lo, imm), _mm256_shuffle_ps(a.hi, b.hi, imm)}; }
inline V16 v16_even_quarters(V16 a, V16 b) {
  return {_mm256_permute2f128_ps(a.lo, a.hi, 0x20), _mm256_permute2f128_ps(b.lo, b.hi, 0x20)};
}
inline V16 v16_odd_quarters(V16 a, V16 b) {
  return {_mm256_permute2f128_ps(a.lo, a.hi, 0x31), _mm256_permute2f128_ps(b.lo, b.hi, 0x31)};
}
inline __m256 v16_fold(V16 a) { return _mm256_add_ps(a.lo, a.hi); }
inline __m256 v16_fold_max(V16 a) { return _mm256_max_ps(a.lo, a.hi); }

#endif

// The sum of the 16 lanes, always as ((l0-7 + l8-15) folded to 4 lanes, then 2, then 1).
inline float v16_reduce_add(V16 a) {
  const __m256 t8 = v16_fold(a);
  const __m128 t4 = _mm_add_ps(_mm256_extractf128_ps(t8, 1), _mm256_castps256_ps128(t8));
  const __m128 t2 = _mm_add_ps(t4, _mm_shuffle_ps(t4, t4, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(t2) + _mm_cvtss_f32(_mm_shuffle_ps(t2, t2, 1));
}

inline float v16_reduce_max(V16 a) {  // max is exact: any order gives the same value
  const __m256 t8 = v16_fold_max(a);
  __m128 t = _mm_max_ps(_mm256_extractf128_ps(t8, 1), _mm256_castps256_ps128(t8));
  t = _mm_max_ps(t, _mm_shuffle_ps(t, t, _MM_SHUFFLE(1, 0, 3, 2)));
  return std::max(_mm_cvtss_f32(t), _mm_cvtss_f32(_mm_shuffle_ps(t, t, 1)));
}

// op over the lanes of each of 16 vectors, as one vector (lane i: op over
// v[i]'s lanes): a tree of lane shuffles and ops, about 3 instructions a
// vector where a horizontal reduction per vector takes 8. op is an
// associative, commutative lane-wise operation.
template <typename Op>
inline V16 reduce16(const V16* v, Op op) {
  V16 a[8], c[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: v[2i] lanes 0+2, v[2i+1] 0+2, v[2i] 1+3, v[2i+1] 1+3
    a[i] = op(v16_unpacklo(v[2 * i], v[2 * i + 1]), v16_unpackhi(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: the lane's op over v[4i], ..., v[4i + 3]
    c[i] = op(v16_shuffle<_MM_SHUFFLE(1, 0, 1, 0)>(a[2 * i], a[2 * i + 1]),
              v16_shuffle<_MM_SHUFFLE(3, 2, 3, 2)>(a[2 * i], a[2 * i + 1]));
  const auto pair_lanes = [&](V16 x, V16 y) {  // [x0 . x1, x2 . x3, y0 . y1, y2 . y3] by 128-bit lane
    return op(v16_even_quarters(x, y), v16_odd_quarters(x, y));
  };
  return pair_lanes(pair_lanes(c[0], c[1]), pair_lanes(c[2], c[3]));
}

inline V16 sum16(const V16* v) { return reduce16(v, [](V16 x, V16 y) { return x + y; }); }
inline V16 max16(const V16* v) { return reduce16(v, [](V16 x, V16 y) { return v16_max(x, y); }); }

}  // namespace kvserve
#endif

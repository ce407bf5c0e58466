// The int8-activation grouped GEMM (grouped_gemm.cpp's tile_rows_a8) on AMX
// tiles, with results equal bit for bit.
//
// tile_rows_a8 computes, per row of x and group of 32 inputs, two int32 dots
// s0, s1 (one per half group: each half has its own activation scale) with
// vpdpbusd, then folds them into the row's float accumulators. AMX-INT8's
// tdpbsud computes the same int32 dots (signed x codes times unsigned weight
// codes, exact integer sums) for 16 rows x 16 outputs x 16 inputs at once: A
// is 16 rows of one half group (16 bytes, rows 32 bytes apart in the
// group-major quantised rows), B is the half group's 4 x 64 bytes of codes,
// which is the packed layout itself (lane i: 4 inputs of output i). The
// dots go through memory to the very float arithmetic of tile_rows_a8, in the
// same order, so only where the integer dots come from differs.
//
// Built for every CPU (target attributes), used where the CPU has AMX-INT8 and
// the kernel granted this process the tile state (arch_prctl, asked once).
//
// For tests on CPUs without AMX, set_amx_emulated(true) runs this same kernel
// with its tile instructions done in software (emu_tile_*, as the ISA reference
// defines them, the tile configuration honoured): everything but the tile
// instructions themselves (operand layouts, strides, which group's dots meet
// which scales) is then tested on any CPU with AVX512-VNNI.
#include "grouped_gemm_amx.h"

#include "parallel.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace kvserve {

namespace {

std::atomic<bool> g_enabled{true};
std::atomic<bool> g_emulated{false};
std::atomic<int64_t> g_emulated_products{0};

#if defined(__x86_64__)
constexpr long kArchReqXcompPerm = 0x1023;  // arch_prctl: ask for an XSAVE feature
constexpr long kXfeatureXtiledata = 18;     // the AMX tile data

bool cpu_has_amx_int8() {
  const unsigned d = cpuid7_edx();
  return (d >> 24 & 1) && (d >> 25 & 1);  // AMX-TILE, AMX-INT8
}

bool ask_for_tiles() { return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0; }

// Tiles (the intrinsics take literal numbers): 0/1 A (x codes, low/high half
// group), 2/3 B (weight codes, same halves), 4/5 and 6/7 C (the dots s0/s1 of
// even and odd groups).

TileConfig tile_config() {
  TileConfig cfg;
  for (int t : {0, 1}) cfg.rows[t] = 16, cfg.colsb[t] = 16;
  for (int t : {2, 3}) cfg.rows[t] = 4, cfg.colsb[t] = 64;
  for (int t : {4, 5, 6, 7}) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  return cfg;
}

void configure_tiles() { load_tile_config(tile_config()); }

// The software tiles: this thread's eight tile registers and configuration.
struct EmulatedTiles {
  TileConfig cfg;
  alignas(64) uint8_t reg[8][16][64];
};
thread_local EmulatedTiles g_tiles;

[[noreturn]] void emulated_fault(const char* what, int tile) {
  // Where the hardware raises #UD: a kernel bug, so fail loudly.
  std::fprintf(stderr, "kvserve: emulated AMX fault: %s (tile %d)\n", what, tile);
  std::abort();
}

void emu_tile_loadconfig(const TileConfig& cfg) {
  g_tiles.cfg = cfg;
  std::memset(g_tiles.reg, 0, sizeof g_tiles.reg);
}

void emu_tile_zero(int t) { std::memset(g_tiles.reg[t], 0, sizeof g_tiles.reg[t]); }

// tileloadd: the configured rows x bytes from base, rows `stride` bytes apart;
// the rest of the register becomes zero.
void emu_tile_loadd(int t, const void* base, int64_t stride) {
  const int rows = g_tiles.cfg.rows[t], colsb = g_tiles.cfg.colsb[t];
  if (rows == 0 || colsb == 0) emulated_fault("tileloadd of an unconfigured tile", t);
  emu_tile_zero(t);
  for (int r = 0; r < rows; ++r) std::memcpy(g_tiles.reg[t][r], static_cast<const uint8_t*>(base) + r * stride, colsb);
}

void emu_tile_stored(int t, void* base, int64_t stride) {
  const int rows = g_tiles.cfg.rows[t], colsb = g_tiles.cfg.colsb[t];
  if (rows == 0 || colsb == 0) emulated_fault("tilestored of an unconfigured tile", t);
  for (int r = 0; r < rows; ++r) std::memcpy(static_cast<uint8_t*>(base) + r * stride, g_tiles.reg[t][r], colsb);
}

// tdpbsud c, a, b: c[m][n] += sum over k < K, i < 4 of int8 a[m][4k + i] x
// uint8 b[k][4n + i], exact int32 sums (M = rows of c, N = its bytes / 4,
// K = a's bytes / 4), with the shape checks that fault on the hardware. Each
// (k, m) step is one vpdpbusd: b's row k is 16 lanes of 4 unsigned bytes, a's
// 4 bytes go to every lane as the signed operand. The 16 rows' sums advance
// together (16 independent chains: 4-5x faster than row after row).
__attribute__((target("avx512f,avx512vnni"))) void emu_tile_dpbsud(int c, int a, int b) {
  EmulatedTiles& tiles = g_tiles;
  const TileConfig& cfg = tiles.cfg;
  const int m_rows = cfg.rows[c], n = cfg.colsb[c] / 4, k = cfg.colsb[a] / 4;
  if (m_rows == 0 || n == 0 || cfg.rows[a] != m_rows || cfg.rows[b] != k || cfg.colsb[b] != cfg.colsb[c])
    emulated_fault("tdpbsud: tile shapes do not match", c);
  const __mmask16 lanes = static_cast<__mmask16>((1u << n) - 1);
  __m512i acc[16];
  for (int m = 0; m < m_rows; ++m) acc[m] = _mm512_maskz_loadu_epi32(lanes, tiles.reg[c][m]);
  for (int kk = 0; kk < k; ++kk) {
    const __m512i bk = _mm512_maskz_loadu_epi32(lanes, tiles.reg[b][kk]);
    for (int m = 0; m < m_rows; ++m) {
      int32_t a4;
      std::memcpy(&a4, tiles.reg[a][m] + 4 * kk, 4);
      acc[m] = _mm512_dpbusd_epi32(acc[m], bk, _mm512_set1_epi32(a4));
    }
  }
  for (int m = 0; m < m_rows; ++m) _mm512_mask_storeu_epi32(tiles.reg[c][m], lanes, acc[m]);
  g_emulated_products.fetch_add(1, std::memory_order_relaxed);
}

bool cpu_can_emulate() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni");
}

// Codes of one group as tdpbsud's B operand: 8 x 64 bytes, rows 0-3 for inputs
// 0..15, rows 4-7 for 16..31 (load_codes' w[0..7] in memory).
template <int kBits>
__attribute__((target("avx512f,avx512bw"))) inline const uint8_t* b_operand(const uint8_t* group, uint8_t* buf) {
  if constexpr (kBits == 8) {
    return group;  // already bytes in that order
  } else {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    for (int j = 0; j < 4; ++j) {
      const __m512i packed = _mm512_loadu_si512(group + j * 64);
      _mm512_storeu_si512(buf + j * 64, _mm512_and_si512(packed, low4));
      _mm512_storeu_si512(buf + (4 + j) * 64, _mm512_and_si512(_mm512_srli_epi16(packed, 4), low4));
    }
    return buf;
  }
}

// Group g's dots for 16 rows into `dots` (s0 then s1, 16 x 16 int32 each), through
// C tiles C0 and C1: two pairs alternate, so that one group's tile work runs
// while the float arithmetic of the group before reads its dots. (A macro: the
// tile intrinsics take their tile numbers as literal text. T is the tile
// instructions' prefix: _tile for the hardware's, emu_tile for the software's.)
#define KVSERVE_GROUP_DOTS(T, C0, C1, qx, b, dots) \
  do {                                             \
    T##_zero(C0);                                  \
    T##_zero(C1);                                  \
    T##_loadd(0, (qx), 32);                        \
    T##_loadd(1, (qx) + 16, 32);                   \
    T##_loadd(2, (b), 64);                         \
    T##_loadd(3, (b) + 256, 64);                   \
    T##_dpbsud(C0, 0, 2);                          \
    T##_dpbsud(C1, 1, 3);                          \
    T##_stored(C0, (dots), 64);                    \
    T##_stored(C1, (dots) + 256, 64);              \
  } while (0)

// KVSERVE_GROUP_DOTS on C pair 0 (tiles 4, 5) or 1 (tiles 6, 7), on the
// hardware's tiles or the software's.
template <bool kEmulated, int kPair>
__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw"))) inline void group_dots(const int8_t* qx,
                                                                                       const uint8_t* b,
                                                                                       int32_t* dots) {
  if constexpr (kEmulated && kPair == 0) KVSERVE_GROUP_DOTS(emu_tile, 4, 5, qx, b, dots);
  else if constexpr (kEmulated) KVSERVE_GROUP_DOTS(emu_tile, 6, 7, qx, b, dots);
  else if constexpr (kPair == 0) KVSERVE_GROUP_DOTS(_tile, 4, 5, qx, b, dots);
  else KVSERVE_GROUP_DOTS(_tile, 6, 7, qx, b, dots);
}

// 16 rows of x (from row r0, valid rows `rows`) against tile t, whose groups' B
// operands lie 512 bytes apart from `bops`: tile_rows_a8's arithmetic.
template <bool kEmulated>
__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw"))) void tile_block(
    float* y, int64_t ys, const AmxRows& x, int64_t r0, int rows, const float* scales,
    int64_t groups, int64_t valid, const uint8_t* bops) {
  alignas(64) int32_t dots[2][2 * 16 * 16];  // per buffer: s0 [16 rows][16], then s1
  __m512 acc[16];
  for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
  const auto qx_of = [&](int64_t g) { return x.q + (g * x.padded_rows + r0) * 32; };
  group_dots<kEmulated, 0>(qx_of(0), bops, dots[0]);
  for (int64_t g = 0; g < groups; ++g) {
    if (g + 1 < groups) {
      const int odd = (g + 1) % 2;
      const uint8_t* b = bops + (g + 1) * 512;
      if (odd) group_dots<kEmulated, 1>(qx_of(g + 1), b, dots[1]);
      else group_dots<kEmulated, 0>(qx_of(g + 1), b, dots[0]);
    }
    const int32_t* dg = dots[g % 2];
    const int64_t first = g * x.padded_rows + r0;
    const __m512 d = _mm512_loadu_ps(scales + g * 32);
    const __m512 m = _mm512_loadu_ps(scales + g * 32 + 16);
    const float* dx = x.d + first * 2;
    const float* shift = x.shift + first;
    const float* sum = x.sum + first;
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) {
      const __m512i s0 = _mm512_load_si512(dg + r * 16), s1 = _mm512_load_si512(dg + 256 + r * 16);
      __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s1), _mm512_set1_ps(dx[2 * r + 1]), _mm512_set1_ps(shift[r]));
      t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s0), _mm512_set1_ps(dx[2 * r]), t);
      acc[r] = _mm512_fmadd_ps(d, t, acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sum[r]), acc[r]);
    }
  }
  const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
  for (int r = 0; r < rows; ++r) _mm512_mask_storeu_ps(y + (r0 + r) * ys, mask, acc[r]);
}

// Tiles [begin, end) over all rows, on the calling thread.
template <int kBits, bool kEmulated>
__attribute__((target("amx-tile,amx-int8,avx512f,avx512bw"))) void run_tiles(
    int64_t begin, int64_t end, float* y, int64_t ys, const AmxRows& x, const uint8_t* codes,
    const float* scales, int64_t groups, int64_t n) {
  constexpr int64_t kGroupBytes = 16 * 32 * kBits / 8;
  // The tile configuration is per-thread state.
  if constexpr (kEmulated) emu_tile_loadconfig(tile_config());
  else configure_tiles();
  // NOTE: a tile's 4-bit codes are unpacked once for all its 16-row blocks (a 256-row
  // prompt chunk unpacked each group 16 times: 5-8% of the GEMM at 64-256 rows). The
  // buffer is thread_local: no allocation per call.
  thread_local std::vector<uint8_t> bufs;
  uint8_t* bbuf = nullptr;
  if constexpr (kBits == 4) {
    bufs.resize(std::max(bufs.size(), static_cast<size_t>(groups) * 512 + 64));
    bbuf = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(bufs.data()) + 63) & ~uintptr_t{63});
  }
  for (int64_t t = begin; t < end; ++t) {
    const int64_t valid = std::min<int64_t>(16, n - t * 16);
    const uint8_t* c = codes + t * groups * kGroupBytes;
    const float* s = scales + t * groups * 32;
    const uint8_t* bops = c;  // 8-bit codes are B operands as they are
    if constexpr (kBits == 4) {
      for (int64_t g = 0; g < groups; ++g) b_operand<kBits>(c + g * kGroupBytes, bbuf + g * 512);
      bops = bbuf;
    }
    for (int64_t r0 = 0; r0 < x.rows; r0 += 16) {
      const int rows = static_cast<int>(std::min<int64_t>(16, x.rows - r0));
      tile_block<kEmulated>(y + t * 16, ys, x, r0, rows, s, groups, valid, bops);
    }
  }
  if constexpr (!kEmulated) _tile_release();
}

// A thread's share is a run of tiles over all rows: each tile's codes are read
// once, and the rows' codes (rows x K bytes) stay in L2.
template <int kBits>
void run(float* y, int64_t ys, const AmxRows& x, const uint8_t* codes, const float* scales, int64_t tiles,
         int64_t groups, int64_t n) {
  const bool emulated = g_emulated.load();
  parallel_chunks(tiles, 1, [&](int64_t begin, int64_t end) {
    if (emulated) run_tiles<kBits, true>(begin, end, y, ys, x, codes, scales, groups, n);
    else run_tiles<kBits, false>(begin, end, y, ys, x, codes, scales, groups, n);
  });
}
#endif

}  // namespace

#if defined(__x86_64__)
__attribute__((target("amx-tile"))) void load_tile_config(const TileConfig& cfg) {
  // NOTE: GCC 12 does not see ldtilecfg read the struct and drops the caller's stores
  // to it without this barrier (the tiles then fault as unconfigured).
  __asm__ volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

unsigned cpuid7_edx() {
  unsigned a, b, c, d;
  return __get_cpuid_count(7, 0, &a, &b, &c, &d) ? d : 0;
}
#else
void load_tile_config(const TileConfig&) {}
unsigned cpuid7_edx() { return 0; }
#endif

bool amx_tiles_granted() {
#if defined(__x86_64__)
  static const bool granted = ask_for_tiles();  // once per process
  return granted;
#else
  return false;
#endif
}

bool amx_available() {
#if defined(__x86_64__)
  static const bool ok = cpu_has_amx_int8() && amx_tiles_granted();
  return ok;
#else
  return false;
#endif
}

bool amx_enabled() { return g_enabled.load() && (g_emulated.load() || amx_available()); }

void set_amx_enabled(bool enabled) { g_enabled.store(enabled); }

bool amx_emulated() { return g_emulated.load(); }

bool set_amx_emulated(bool emulated) {
#if defined(__x86_64__)
  static const bool can = cpu_can_emulate();
  g_emulated.store(emulated && can);
#else
  (void)emulated;
#endif
  return g_emulated.load();
}

int64_t amx_emulated_products() { return g_emulated_products.load(); }

void grouped_linear_a8_amx(int bits, float* y, int64_t ys, const AmxRows& x, const uint8_t* codes,
                           const float* scales, int64_t tiles, int64_t groups, int64_t n) {
#if defined(__x86_64__)
  if (bits == 4) run<4>(y, ys, x, codes, scales, tiles, groups, n);
  else run<8>(y, ys, x, codes, scales, tiles, groups, n);
#else
  (void)bits, (void)y, (void)ys, (void)x, (void)codes, (void)scales, (void)tiles, (void)groups, (void)n;
#endif
}

}  // namespace kvserve

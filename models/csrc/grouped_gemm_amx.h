// The int8-activation grouped GEMM on AMX tiles (grouped_gemm_amx.cpp).
#pragma once

#include <cstdint>

namespace kvserve {

// Rows of x rounded to int8 as grouped_gemm.cpp's QuantizedRows holds them
// (group-major), with room for `padded_rows` (a multiple of 16) rows per group;
// the rows past `rows` are zeros.
struct AmxRows {
  const int8_t* q;      // [groups][padded_rows][32]
  const float* d;       // [groups][padded_rows][2]
  const float* shift;   // [groups][padded_rows]
  const float* sum;     // [groups][padded_rows]
  int64_t rows, padded_rows;
};

// ldtilecfg's 64-byte operand (palette 1): each tile's rows and bytes per row.
struct TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// ldtilecfg: `cfg` becomes the calling thread's tile configuration (x86-64 only).
void load_tile_config(const TileConfig& cfg);

// CPUID leaf 7's EDX, where the AMX feature bits are (0 where there is no leaf 7).
unsigned cpuid7_edx();

// The CPU has AMX-INT8 and the kernel granted this process the tile state
// (asked once, on the first call).
bool amx_available();
// Whether the OS granted this process the AMX tile state (asked once; any AMX instruction needs it).
bool amx_tiles_granted();
// Whether the CPU has AMX-BF16 and the OS granted the tiles (dense_gemm_amx.cpp).
bool amx_bf16_available();
// amx_available() and not turned off by set_amx_enabled(false).
bool amx_enabled();
void set_amx_enabled(bool enabled);

// Tests: the AMX kernel with its tile instructions done in software (the same
// code otherwise), on a CPU with AVX512-VNNI whether it has AMX or not. While
// on, amx_enabled() needs no AMX. Returns whether it is on.
bool set_amx_emulated(bool emulated);
bool amx_emulated();
// Tile products (tdpbsud) the software tiles have computed, for tests that
// want to see the emulated kernel run.
int64_t amx_emulated_products();

// y [rows, n] (row stride ys) = the int8-activation GEMM of grouped_gemm.cpp for
// `bits`-bit packed codes, equal bit for bit to the VNNI kernel.
void grouped_linear_a8_amx(int bits, float* y, int64_t ys, const AmxRows& x, const uint8_t* codes,
                           const float* scales, int64_t tiles, int64_t groups, int64_t n);

}  // namespace kvserve

// The 16-value tables of GGUF's lookup types, shared by the blocks' decoding (gguf_repack.cpp)
// and the int8-activation kernels that look 4-bit indices up in them (gguf_a8.cpp).
#pragma once

#include <cstdint>

#include "kernels.h"

namespace kvserve {

// IQ4_NL's and IQ4_XS's codebook (llama.cpp's kvalues_iq4nl).
inline constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
// MXFP4's E2M1 values, doubled to integers (llama.cpp's kvalues_mxfp4); the block's E8M0
// exponent e makes d = 2^(e - 128), the half its value would be.
inline constexpr int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// The table a format of 4-bit indices (kA8MX4, kA8NL4, kA8NX4) looks them up in.
inline const int8_t* a8_table(int64_t format) { return format == kA8MX4 ? kMxfp4Values : kIq4Values; }

}  // namespace kvserve

// What gguf_a8.cpp's GEMM and gguf_experts.cpp's experts share: a weight's segment in one of
// the A8Formats, checked once, and the product of rows of int8 x with one of its 16-row tiles.
#pragma once

#include <ATen/core/Tensor.h>

#include "grouped_rows.h"

#include <cstddef>
#include <cstdint>

namespace kvserve {

struct A8Segment {
  int64_t format;        // A8Format
  const uint8_t* codes;  // tile t's codes from codes + t * code_bytes
  const float* scales;   // its scales from scales + t * scale_floats (D, A: float16, MX4: bytes; in floats' bytes)
  int64_t tiles, code_bytes, scale_floats;
};

// Segment i of a weight (the messages name it): codes [tiles, K/32, bits, 64] and their scales
// in `format`, checked against `groups` = K/32. The tensors must outlive the segment.
A8Segment a8_segment(size_t i, const at::Tensor& codes, const at::Tensor& scales, int64_t format, int64_t groups);

// Rows [r0, r0 + rows) of xq (rows <= grouped::kRowsInt8) against tile t of seg: row r's
// outputs to y[(r - r0) * ys + i] for i < valid. A row's result does not depend on `rows`, on
// the other rows, on `plain` (the portable C++: the same bits) or on `once` (the call reads
// this tile in this pass alone: its codes are asked for non-temporally, gguf_a8.cpp).
void a8_tile(const A8Segment& seg, int64_t t, float* y, int64_t ys, const grouped::QuantizedRows& xq, int64_t r0,
             int rows, int64_t groups, int64_t valid, bool plain, bool once);

}  // namespace kvserve

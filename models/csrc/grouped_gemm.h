// The grouped 4-/8-bit GEMMs of grouped_gemm.cpp, which describes the packed
// layout and the two kinds of arithmetic.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

// x [M, K] float32 @ W^T, W packed as grouped_gemm.cpp describes -> out [M, N] float32.
void grouped_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                    bool int8_activations, bool plain);
// What the int8-activation path's integer dots run on: "avx512-vnni", "avx512-bw",
// "avx2", or "" where they run on the plain C++.
std::string int8_dots();

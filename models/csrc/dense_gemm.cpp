// y = x @ W^T for unquantised weights (float32 or bfloat16), with an
// arithmetic that does not depend on the batch: every output is one chain of
// FMAs over k = 0..K-1 in order, from zero, whatever the number of rows, the
// rows beside it or the thread that runs it. MKL's and oneDNN's GEMMs pick
// their blocking (and so their summation order) from the matrix sizes: a
// token's logits changed with the number of tokens that shared its step
// (issue 14), so the `none` path runs this instead.
//
// Packed layout: W [N, K] as tiles of 16 output rows, each stored input by
// input: w[t][k][i] = W[16t + i][k], rows padded to a multiple of 16 with
// zeros. One input's 16 weights are one vector, multiplied by a broadcast
// input of each row.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>

#include "cache_rows.h"
#include "kernels.h"
#include "parallel.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace kvserve {
namespace {

constexpr int64_t kTile = 16;      // outputs per vector
// Rows of x per pass: 2 tiles x 6 rows = 12 FMA chains in flight in AVX-512's
// 32 registers; AVX2's 16 registers of half the width hold 2 x 3. Each output's
// chain is the same whatever the rows beside it.
#if defined(KVSERVE_V16_AVX2)
constexpr int kRows = 3;
#else
constexpr int kRows = 6;
#endif
constexpr int64_t kRowBlock = 48;  // rows a work item takes through its tiles (their floats stay in L1/L2)
constexpr int64_t kTileGrain = 4;  // tiles per work item

template <typename W>
inline float weight_at(const W* w) { return static_cast<float>(*w); }

#if defined(KVSERVE_V16)

// R rows of x (float32, stride xs) against NT consecutive tiles: acc = fma(x[k], w[k], acc), k in order.
template <typename W, int R, int NT>
inline void tiles_rows(float* y, int64_t ys, const float* x, int64_t xs, const W* w, int64_t k_len,
                       const int64_t* valid) {
  V16 acc[NT][R];
  for (int t = 0; t < NT; ++t)
    for (int r = 0; r < R; ++r) acc[t][r] = v16_zero();
  for (int64_t k = 0; k < k_len; ++k) {
    V16 wv[NT];
    for (int t = 0; t < NT; ++t) wv[t] = load16(w + (t * k_len + k) * kTile);  // 16 weights as float32 (cache_rows.h)
    for (int r = 0; r < R; ++r) {
      const V16 xv = v16_set1(x[r * xs + k]);
      for (int t = 0; t < NT; ++t) acc[t][r] = v16_fmadd(xv, wv[t], acc[t][r]);
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int r = 0; r < R; ++r) v16_store_n(y + r * ys + t * kTile, acc[t][r], static_cast<int>(valid[t]));
}

template <typename W, int NT, int R = kRows>
inline void tiles_rows_n(int rows, float* y, int64_t ys, const float* x, int64_t xs, const W* w, int64_t k_len,
                         const int64_t* valid) {
  if constexpr (R > 0) {
    if (rows == R) return tiles_rows<W, R, NT>(y, ys, x, xs, w, k_len, valid);
    return tiles_rows_n<W, NT, R - 1>(rows, y, ys, x, xs, w, k_len, valid);
  }
}
#endif

// The same products for rows of x against one tile, in portable C++ (the same order: FMA per input).
template <typename W>
void tile_rows_plain(int rows, float* y, int64_t ys, const float* x, int64_t xs, const W* w, int64_t k_len,
                     int64_t valid) {
  for (int r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < valid; ++i) {
      float acc = 0.0f;
      for (int64_t k = 0; k < k_len; ++k) acc = std::fma(x[r * xs + k], weight_at(w + k * kTile + i), acc);
      y[r * ys + i] = acc;
    }
  }
}

template <typename W>
void dense_linear_impl(at::Tensor& out, const at::Tensor& x, const W* w, int64_t tiles) {
  const int64_t rows = x.size(0), k_len = x.size(1), n = out.size(1);
  // Rows as float32 (bfloat16 activations converted once), and float32 outputs rounded at the end.
  at::Tensor xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
  at::Tensor yf = out.scalar_type() == at::kFloat ? out : at::empty({rows, n}, out.options().dtype(at::kFloat));
  const float* xp = xf.data_ptr<float>();
  float* yp = yf.data_ptr<float>();
  const int64_t xs = xf.stride(0), ys = yf.stride(0);
  const int64_t row_blocks = (rows + kRowBlock - 1) / kRowBlock;
  // Claims of kTileGrain tiles, fewer where that would leave a thread without one: a MoE
  // router's 4 tiles (OLMoE's 64 experts) were one claim, one thread reading its 512 KB while
  // the other waited (27-30 us a layer, one row). A tile's products do not depend on its claim.
  const int64_t grain = std::clamp<int64_t>(tiles / std::max(at::get_num_threads(), 1), 1, kTileGrain);
  const int64_t tile_chunks = (tiles + grain - 1) / grain;
  parallel_chunks(tile_chunks * row_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t0 = (item / row_blocks) * grain, t1 = std::min(tiles, t0 + grain);
      const int64_t r0 = (item % row_blocks) * kRowBlock, r1 = std::min(rows, r0 + kRowBlock);
      for (int64_t r = r0; r < r1; r += kRows) {
        const int nr = static_cast<int>(std::min<int64_t>(kRows, r1 - r));
        for (int64_t t = t0; t < t1;) {
          const int64_t valid[2] = {std::min(kTile, n - t * kTile), std::min(kTile, n - (t + 1) * kTile)};
          float* y = yp + r * ys + t * kTile;
          const float* xr = xp + r * xs;
          const W* wt = w + t * k_len * kTile;
#if defined(KVSERVE_V16)
          if (t + 1 < t1) {
            tiles_rows_n<W, 2>(nr, y, ys, xr, xs, wt, k_len, valid);
            t += 2;
          } else {
            tiles_rows_n<W, 1>(nr, y, ys, xr, xs, wt, k_len, valid);
            t += 1;
          }
#else
          tile_rows_plain(nr, y, ys, xr, xs, wt, k_len, valid[0]);
          t += 1;
#endif
        }
      }
    }
  });
  if (!yf.is_same(out)) out.copy_(yf);
}

}  // namespace

// x [M, K] float32 or bfloat16 (rows contiguous), w [N/16, K, 16] (float32,
// or bfloat16 for bfloat16 x) -> out [M, N] in x's dtype.
void dense_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [M, K] with contiguous rows");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.scalar_type() == x.scalar_type() && out.size(0) == x.size(0),
              "out must be contiguous [M, N] in x's dtype");
  TORCH_CHECK(w.dim() == 3 && w.is_contiguous() && w.size(2) == kTile && w.size(1) == x.size(1),
              "w must be contiguous [N/16, K, 16]");
  const int64_t tiles = w.size(0), n = out.size(1);
  TORCH_CHECK(tiles * kTile >= n && (tiles - 1) * kTile < n, "out width does not match the packed weight");
  if (x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat) {
    dense_linear_impl<float>(out, x, w.data_ptr<float>(), tiles);
  } else if (x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16) {
    dense_linear_impl<at::BFloat16>(out, x, w.data_ptr<at::BFloat16>(), tiles);
  } else {
    TORCH_CHECK(false, "dense_linear: float32 x with float32 w, or bfloat16 with bfloat16");
  }
}

}  // namespace kvserve

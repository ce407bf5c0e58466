// The greedy sampler's argmax over each row of the logits.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>

#include "kernels.h"
#include "parallel.h"
#include "vec16.h"  // KVSERVE_V16_AVX512: the AVX-512 build, not the forced AVX2 one

#include <cmath>
#include <cstdint>

namespace kvserve {
namespace {

// Whether v wins over m: larger, or NaN over a number (torch.argmax's order).
inline bool beats(float v, float m) { return v > m || (std::isnan(v) && !std::isnan(m)); }

// The index of the row's winning value, the first one on ties.
inline int64_t argmax_row(const float* x, int64_t n) {
  int64_t best = 0, i = 1;
  float m = x[0];
#if defined(KVSERVE_V16_AVX512)
  if (n >= 32) {
    // Lane l follows indices l, l + 16, ...; a strict win keeps its first.
    __m512 mv = _mm512_loadu_ps(x);
    __m512i iv = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i cur = iv;
    const __m512i step = _mm512_set1_epi32(16);
    for (i = 16; i + 16 <= n; i += 16) {
      cur = _mm512_add_epi32(cur, step);
      const __m512 v = _mm512_loadu_ps(x + i);
      const __mmask16 win = _mm512_cmp_ps_mask(v, mv, _CMP_GT_OQ) |
                            (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) & ~_mm512_cmp_ps_mask(mv, mv, _CMP_UNORD_Q));
      mv = _mm512_mask_mov_ps(mv, win, v);
      iv = _mm512_mask_mov_epi32(iv, win, cur);
    }
    alignas(64) float vals[16];
    alignas(64) int32_t idx[16];
    _mm512_store_ps(vals, mv);
    _mm512_store_si512(idx, iv);
    m = vals[0];
    best = idx[0];
    for (int l = 1; l < 16; ++l) {
      // Neither wins (equal, or both NaN): the earlier index.
      if (beats(vals[l], m) || (!beats(m, vals[l]) && idx[l] < best)) {
        m = vals[l];
        best = idx[l];
      }
    }
  }
#endif
  for (; i < n; ++i) {  // indices above every one seen: a strict win only
    if (beats(x[i], m)) {
      m = x[i];
      best = i;
    }
  }
  return best;
}

}  // namespace

// out[r] = argmax(x[r]) for float32 x [S, V] (rows may be strided): the
// greedy sampler's step, one pass over each row (torch's argmax takes about
// 5 ms for 64 rows of a 49152-token vocabulary here).
void argmax_rows(at::Tensor& out, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat && x.size(1) >= 1,
              "x must be float32 [S, V] with V >= 1 and contiguous rows");
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kLong && out.numel() == x.size(0),
              "out must be int64 [S]");
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t n = x.size(1), xs = x.stride(0);
  kvserve::parallel_chunks(x.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * xs, n);
  });
}

}  // namespace kvserve

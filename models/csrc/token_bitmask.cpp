// Structured outputs: a grammar's allowed-token bitmask applied to the logits.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>

#include "kernels.h"
#include "vec16.h"  // KVSERVE_V16_AVX512: the AVX-512 build, not the forced AVX2 one

#include <algorithm>
#include <cstdint>
#include <limits>

namespace kvserve {

// logits [S, V] float32 (rows contiguous), rows [R] int64 (rows of logits),
// masks [R, W] int32 with W >= ceil(V / 32): bit b of masks[i][w] set means
// token 32w + b is allowed in row rows[i]. Every other token of those rows
// becomes -inf, in place. A word is 32 tokens; most words of a grammar's mask
// are all-allowed or all-forbidden, so the AVX-512 build writes a word's
// forbidden lanes with two masked stores.
void apply_token_bitmask(at::Tensor& logits, const at::Tensor& rows, const at::Tensor& masks) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.scalar_type() == at::kFloat,
              "logits must be float32 [S, V] with contiguous rows");
  TORCH_CHECK(rows.dim() == 1 && rows.is_contiguous() && rows.scalar_type() == at::kLong, "rows: int64 [R]");
  TORCH_CHECK(masks.dim() == 2 && masks.is_contiguous() && masks.scalar_type() == at::kInt &&
                  masks.size(0) == rows.size(0),
              "masks: contiguous int32 [R, W], one per row");
  const int64_t vocab = logits.size(1), words = masks.size(1);
  TORCH_CHECK(words * 32 >= vocab, "masks have fewer bits than the vocabulary");
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  const uint32_t* bits_all = reinterpret_cast<const uint32_t*>(masks.data_ptr<int32_t>());
  float* base = logits.data_ptr<float>();
  const float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < rows.size(0); ++i) {
    TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < logits.size(0), "row ", row_ids[i], " out of range");
    float* row = base + row_ids[i] * logits.stride(0);
    const uint32_t* bits = bits_all + i * words;
    for (int64_t w = 0; w * 32 < vocab; ++w) {
      const uint32_t allowed = bits[w];
      if (allowed == 0xFFFFFFFFu) continue;
      const int64_t first = w * 32, n = std::min<int64_t>(32, vocab - first);
      const uint32_t valid = n == 32 ? 0xFFFFFFFFu : ((1u << n) - 1);
      const uint32_t forbid = ~allowed & valid;
#if defined(KVSERVE_V16_AVX512)
      const __m512 v = _mm512_set1_ps(ninf);
      _mm512_mask_storeu_ps(row + first, static_cast<__mmask16>(forbid & 0xFFFF), v);
      _mm512_mask_storeu_ps(row + first + 16, static_cast<__mmask16>(forbid >> 16), v);
#else
      for (int64_t b = 0; b < n; ++b)
        if (forbid >> b & 1u) row[first + b] = ninf;
#endif
    }
  }
}

}  // namespace kvserve

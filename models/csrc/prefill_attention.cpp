// Paged prefill attention: causal attention of prompt chunks (several query
// tokens per sequence) over the paged caches, flash-attention style.
#include <ATen/ATen.h>

#include "attention.h"
#include "cache_rows.h"
#include "fastmath.h"
#include "kernels.h"
#include "parallel.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace kvserve {
namespace {

// Query tokens per work item, and keys per softmax update (a tile of each).
constexpr int64_t kQueryTile = 16;
constexpr int64_t kKeyTile = 16;

// One cache row as float32 (times its int8 scale), 16 values at a time where the
// hardware converts them.
template <typename C>
inline void row_to_float(float* dst, const C* row, int64_t d) {
  const float s = row_scale(row, d);
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= d; i += 16) _mm512_storeu_ps(dst + i, _mm512_mul_ps(load16(row + i), _mm512_set1_ps(s)));
#endif
  for (; i < d; ++i) dst[i] = to_f(row[i]) * s;
}

#if defined(__AVX512F__)
// R consecutive query rows (q, acc: [R][d]) against one key tile (kt: [d][16]
// keys transposed, vt: [16][d] values; row r sees the first valid[r] keys):
// scores in one vector per row, the online softmax update of (max, sum), and
// acc = acc * alpha + p @ vt. Several rows at once share each key and value
// load and keep 2R independent FMA chains in flight (one row alone waits on
// its FMAs' latency).
template <int R>
inline void prefill_rows_avx512(const float* q, float* acc, const float* kt, const float* vt, int64_t d,
                                const int64_t* valid, float* max, float* sum) {
  __m512 s0[R], s1[R];
  for (int r = 0; r < R; ++r) s0[r] = s1[r] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 2 <= d; i += 2) {
    const __m512 k0 = _mm512_loadu_ps(kt + i * 16), k1 = _mm512_loadu_ps(kt + (i + 1) * 16);
    for (int r = 0; r < R; ++r) {
      s0[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * d + i]), k0, s0[r]);
      s1[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * d + i + 1]), k1, s1[r]);
    }
  }
  for (; i < d; ++i)
    for (int r = 0; r < R; ++r) s0[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * d + i]), _mm512_loadu_ps(kt + i * 16), s0[r]);
  alignas(64) float pv[R][16];
  __m512 alpha[R];
  int64_t keys = 0;
  for (int r = 0; r < R; ++r) {
    const __m512 sc = _mm512_add_ps(s0[r], s1[r]);
    const __mmask16 mask = static_cast<__mmask16>((1u << valid[r]) - 1);
    const float m = std::max(max[r], _mm512_mask_reduce_max_ps(mask, sc));
    const float a = exp_approx(max[r] - m);  // 0 on the first tile (max = -inf, clamped)
    const __m512 p = _mm512_maskz_mov_ps(mask, exp_approx16(_mm512_sub_ps(sc, _mm512_set1_ps(m))));
    max[r] = m;
    sum[r] = sum[r] * a + _mm512_reduce_add_ps(p);
    _mm512_store_ps(pv[r], p);
    alpha[r] = _mm512_set1_ps(a);
    keys = std::max(keys, valid[r]);
  }
  for (int64_t i0 = 0; i0 < d; i0 += 16) {
    __m512 o[R];
    for (int r = 0; r < R; ++r) o[r] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * d + i0), alpha[r]);
    for (int64_t j = 0; j < keys; ++j) {
      const __m512 v = _mm512_loadu_ps(vt + j * d + i0);
      for (int r = 0; r < R; ++r) o[r] = _mm512_fmadd_ps(_mm512_set1_ps(pv[r][j]), v, o[r]);
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc + r * d + i0, o[r]);
  }
}
#endif

// The attention of one tile of up to kQueryTile query tokens of one sequence,
// for the `group` query heads of KV head h, over keys 0..(its last position),
// read from the paged caches: a flash-attention pass over key tiles with an
// online softmax, so no [queries x context] score matrix is formed. Rows r of
// the tile are (token r / group, head r % group).
struct PrefillTile {
  const int64_t* table;  // the sequence's block table
  int64_t first_pos;     // position of the tile's first query token
  int64_t tokens;        // query tokens in the tile
};

template <typename T, typename C>
void prefill_tile(T* out, int64_t out_stride, const T* q, int64_t q_stride, const C* kc, const C* vc,
                  const PrefillTile& tile, int64_t h, int64_t group, int64_t d, int64_t kv_heads,
                  int64_t block_size, float scale, std::vector<float>& buf) {
  const int64_t rows = tile.tokens * group;
  const int64_t row = d + kRowExtra<C>, token_stride = kv_heads * row;
  buf.resize(rows * d * 2 + rows * 2 + d * kKeyTile * 2 + d);
  float* qf = buf.data();      // [rows][d], scaled
  float* acc = qf + rows * d;  // [rows][d]
  float* mx = acc + rows * d;  // [rows] running max of the scores
  float* sum = mx + rows;      // [rows] running sum of exp(score - max)
  float* kt = sum + rows;      // [d][kKeyTile]: this key tile, transposed
  float* vt = kt + d * kKeyTile;  // [kKeyTile][d]
  float* tmp = vt + kKeyTile * d;  // [d]: one key row
  thread_local std::vector<int64_t> valid_keys;  // per row: how many of the tile's keys it sees
  valid_keys.resize(rows);
  int64_t* valid = valid_keys.data();
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = q + (r / group) * q_stride + (h * group + r % group) * d;
    for (int64_t i = 0; i < d; ++i) qf[r * d + i] = to_f(src[i]) * scale;
    std::fill(acc + r * d, acc + (r + 1) * d, 0.0f);
    mx[r] = -std::numeric_limits<float>::infinity();
    sum[r] = 0.0f;
  }
  const int64_t end = tile.first_pos + tile.tokens;  // keys 0..end-1 are seen by some row
  for (int64_t k0 = 0; k0 < end; k0 += kKeyTile) {
    const int64_t nk = std::min(kKeyTile, end - k0);
    for (int64_t j = 0; j < kKeyTile; ++j) {
      if (j < nk) {
        const int64_t pos = k0 + j;
        const int64_t off = (tile.table[pos / block_size] * block_size + pos % block_size) * token_stride + h * row;
        row_to_float(tmp, kc + off, d);
        for (int64_t i = 0; i < d; ++i) kt[i * kKeyTile + j] = tmp[i];
        row_to_float(vt + j * d, vc + off, d);
      } else {
        for (int64_t i = 0; i < d; ++i) kt[i * kKeyTile + j] = 0.0f;
      }
    }
    // Rows before the tile's first key see none of it; every later row sees some.
    const int64_t first = std::max<int64_t>(0, (k0 - tile.first_pos) * group);
    for (int64_t r = first; r < rows; ++r) valid[r] = std::min(nk, tile.first_pos + r / group - k0 + 1);
    int64_t r = first;
#if defined(__AVX512F__)
    if (d % 16 == 0) {
      for (; r + 4 <= rows; r += 4) prefill_rows_avx512<4>(qf + r * d, acc + r * d, kt, vt, d, valid + r, mx + r, sum + r);
      for (; r < rows; ++r) prefill_rows_avx512<1>(qf + r * d, acc + r * d, kt, vt, d, valid + r, mx + r, sum + r);
    }
#endif
    for (; r < rows; ++r) {
      float* ar = acc + r * d;
      float s[kKeyTile];
      for (int64_t j = 0; j < kKeyTile; ++j) s[j] = 0.0f;
      const float* qr = qf + r * d;
      for (int64_t i = 0; i < d; ++i) {
        const float qi = qr[i];
#pragma omp simd
        for (int64_t j = 0; j < kKeyTile; ++j) s[j] += qi * kt[i * kKeyTile + j];
      }
      float m = mx[r];
      for (int64_t j = 0; j < valid[r]; ++j) m = std::max(m, s[j]);
      const float alpha = exp_approx(mx[r] - m);  // 0 on the first tile (mx = -inf, clamped)
      float p[kKeyTile], psum = 0.0f;
      for (int64_t j = 0; j < kKeyTile; ++j) {
        p[j] = j < valid[r] ? exp_approx(s[j] - m) : 0.0f;
        psum += p[j];
      }
      mx[r] = m;
      sum[r] = sum[r] * alpha + psum;
      for (int64_t i = 0; i < d; ++i) {
        float a = ar[i] * alpha;
        for (int64_t j = 0; j < valid[r]; ++j) a += p[j] * vt[j * d + i];
        ar[i] = a;
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = out + (r / group) * out_stride + (h * group + r % group) * d;
    const float inv = 1.0f / sum[r];
    for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<T>(acc[r * d + i] * inv);
  }
}

// Causal attention for sequences of several query tokens each (prompts, or
// chunks of them after a cached prefix): sequence i's tokens are rows
// starts[i]..starts[i+1]-1 of q and the last of its lens[i] positions, whose
// K/V are already in the caches. One work item per (sequence, KV head, tile
// of kQueryTile tokens); later tiles see more keys, so items are claimed one
// at a time (parallel_chunks), the costliest first, rather than split evenly.
template <typename T, typename C>
void prefill_attention_impl(T* out, const T* q, int64_t q_stride, const C* kc, const C* vc, const int64_t* tables,
                            const int64_t* lens, const int64_t* starts, int64_t seqs, int64_t heads,
                            int64_t kv_heads, int64_t d, int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t group = heads / kv_heads;
  std::vector<int64_t> first_item(seqs + 1, 0);  // items of sequence i: first_item[i]..first_item[i+1]-1
  for (int64_t i = 0; i < seqs; ++i) {
    const int64_t tiles = (starts[i + 1] - starts[i] + kQueryTile - 1) / kQueryTile;
    first_item[i + 1] = first_item[i] + tiles * kv_heads;
  }
  kvserve::parallel_chunks(first_item[seqs], 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> buf;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = std::upper_bound(first_item.begin(), first_item.end(), item) - first_item.begin() - 1;
      const int64_t qlen = starts[i + 1] - starts[i], tiles = (qlen + kQueryTile - 1) / kQueryTile;
      // Last tiles first: they see the most keys, and the cheap ones at the end
      // even out the threads' finishing times.
      const int64_t local = item - first_item[i], tile = tiles - 1 - local / kv_heads, h = local % kv_heads;
      const int64_t t0 = tile * kQueryTile, row0 = starts[i] + t0;
      const PrefillTile pt{tables + i * max_blocks, lens[i] - qlen + t0, std::min(kQueryTile, qlen - t0)};
      prefill_tile(out + row0 * heads * d, heads * d, q + row0 * q_stride, q_stride, kc, vc, pt, h, group, d,
                   kv_heads, block_size, scale, buf);
    }
  });
}

}  // namespace

// q [T, H, D] (rows may be strided) holds the query tokens of S sequences,
// sequence i's at rows query_start[i]..query_start[i+1]-1, the last of its
// context_lens[i] positions; caches as paged_decode_attention's; out [T, H, D].
void paged_prefill_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_tables,
                             const at::Tensor& context_lens, const at::Tensor& query_start, double scale) {
  const PagedShapes p = check_paged(out, q, k_cache, v_cache, block_tables, context_lens);
  const int64_t seqs = context_lens.numel();
  TORCH_CHECK(query_start.is_contiguous() && query_start.scalar_type() == at::kLong && query_start.numel() == seqs + 1,
              "query_start: int64, one more than the sequences");
  const int64_t* starts = query_start.data_ptr<int64_t>();
  TORCH_CHECK(starts[0] == 0 && starts[seqs] == q.size(0), "query_start must run from 0 to the number of tokens");
  for (int64_t i = 0; i < seqs; ++i) {
    const int64_t qlen = starts[i + 1] - starts[i];
    TORCH_CHECK(qlen >= 1 && qlen <= p.lens[i], "sequence ", i, ": ", qlen, " query tokens, context length ", p.lens[i]);
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_prefill_attention", [&] {
    dispatch_cache_type(k_cache.scalar_type(), [&](auto cache_tag) {
      using C = decltype(cache_tag);
      prefill_attention_impl(out.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(), q.stride(0),
                             static_cast<const C*>(k_cache.data_ptr()), static_cast<const C*>(v_cache.data_ptr()),
                             p.tables, p.lens, starts, seqs, p.heads, p.kv_heads, p.head_dim, p.block_size,
                             p.max_blocks, static_cast<float>(scale));
    });
  });
}

}  // namespace kvserve

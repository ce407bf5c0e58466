// Paged attention read in place: decode tokens (one query token per
// sequence) and prompt chunks (several, causal) over the paged KV caches.
//
// Both go through one routine, attend_token: a query token's heads sharing a
// KV head, over its context. So a token's attention is the same arithmetic,
// bit for bit, whether it runs as a decode, inside a prompt chunk of any size
// or after a cached prefix of any length: every reduction here has a fixed
// order that depends only on the token's context length (explicit vector
// code, never a compiler-chosen reduction, whose order could follow a
// buffer's alignment). A flash-attention tile over 16 query tokens shared key
// loads between them but reduced in another order than a decode, so a
// prefix-cache hit changed the logits (issue 14).
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>

#include "cache_rows.h"
#include "fastmath.h"
#include "kernels.h"
#include "parallel.h"
#include "vec16.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace kvserve {
namespace {

// max(s[0..n)), n >= 1. GCC keeps a float max reduction scalar (a chain of
// dependent vmaxss), so the vector build spells out the vector loop.
inline float row_max(const float* s, int64_t n) {
  float mx = s[0];
  int64_t t = 1;
#if defined(KVSERVE_V16)
  if (n >= 16) {
    V16 m = v16_load(s);
    for (t = 16; t + 16 <= n; t += 16) m = v16_max(m, v16_load(s + t));
    mx = v16_reduce_max(m);
  }
#endif
  for (; t < n; ++t) mx = std::max(mx, s[t]);
  return mx;
}

// Softmax of each of ``rows`` score rows of length n, in place. The sum runs
// in 16 lanes over the row in order, then one fixed lane reduction. ``sinks``
// (one logit per row, or null): gpt-oss's attention sink, a logit with no value
// that joins each row's softmax (its max and its sum) and takes its share away.
inline void softmax_rows(float* s, int64_t rows, int64_t n, const float* sinks = nullptr) {
  for (int64_t g = 0; g < rows; ++g, s += n) {
    const float mx = sinks ? std::max(row_max(s, n), sinks[g]) : row_max(s, n);
    float sum = 0.0f;
    int64_t t = 0;
#if defined(KVSERVE_V16)
    const V16 m = v16_set1(mx);
    V16 acc = v16_zero();
    for (; t + 16 <= n; t += 16) {
      const V16 e = exp_approx16(v16_load(s + t) - m);
      v16_store(s + t, e);
      acc = acc + e;
    }
    if (t < n) {
      const int rest = static_cast<int>(n - t);
      const V16 e = v16_first_n(exp_approx16(v16_load_n(s + t, rest) - m), rest);
      v16_store_n(s + t, e, rest);
      acc = acc + e;
      t = n;
    }
    sum = v16_reduce_add(acc);
#endif
    for (; t < n; ++t) {
      s[t] = exp_approx(s[t] - mx);
      sum += s[t];
    }
    if (sinks) sum += exp_approx(sinks[g] - mx);
    const float inv = 1.0f / sum;
    for (t = 0; t < n; ++t) s[t] *= inv;
  }
}

// s[i] = cap * tanh(s[i] / cap) for n scores (Gemma 2's attention soft-capping), before
// the softmax. std::tanh stays a scalar call (no -ffast-math, so no vector clone): each
// value's result depends on it alone, never on its place in the row, and so decodes and
// prompt chunks stay equal bit for bit; an exp-based tanh lost 1e-7 absolute near 0.
inline void softcap_rows(float* s, int64_t n, float cap) {
  const float inv = 1.0f / cap;
  for (int64_t i = 0; i < n; ++i) s[i] = cap * std::tanh(s[i] * inv);
}

template <typename T>
inline void axpy_row(float* acc, float p, const T* v, int64_t n) {
#if defined(KVSERVE_V16)
  if (n % 16 == 0) {
    const V16 pv = v16_set1(p);
    for (int64_t d = 0; d < n; d += 16) v16_store(acc + d, v16_fmadd(pv, load16(v + d), v16_load(acc + d)));
    return;
  }
#endif
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) acc[d] += p * to_f(v[d]);
}

// One sequence's view of the paged caches [num_blocks, block_size, KVH, D]: a head's row
// of token t in a block is token_stride elements after token t - 1's (cache_strides).
struct PagedView {
  int64_t block_size, token_stride, block_stride;
  const int64_t* table;
};

// Calls f(t, row_offset) for t = 0..ctx-1 in order, block by block (no
// division per token): row_offset is where token t's row for this KV head
// starts in `cache`. Each block first asks for the next block's rows
// (`row_bytes` each): blocks sit anywhere in the cache, so the hardware
// prefetcher cannot guess the next one, and a decode step at 64 sequences
// waits on memory. `also`, if given, is a second cache whose same rows are
// asked for too, into L2: the scores pass asks for the value rows the values
// pass reads next (64 sequences of 193 tokens, 30 layers: 20.7 -> 19.6 ms).
template <int Locality>
inline void prefetch_rows(const char* row, int64_t n, int64_t stride, int64_t row_bytes) {
  if (stride == row_bytes) {  // (a head-major block: one run, each line asked for once)
    const char* end = row + n * row_bytes;
    for (row -= reinterpret_cast<uintptr_t>(row) % 64; row < end; row += 64) __builtin_prefetch(row, 0, Locality);
    return;
  }
  for (int64_t j = 0; j < n; ++j, row += stride) {
    for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(row + b, 0, Locality);
  }
}

// Tokens before `first` (outside a sliding window) are not visited: their blocks are
// skipped whole, and f's t still counts from the sequence's start.
template <typename C, typename F>
inline void for_each_token(const C* cache, int64_t row_bytes, const PagedView& pv, int64_t head_offset, int64_t first,
                           int64_t ctx, F&& f, const C* also = nullptr) {
  const int64_t blocks = (ctx + pv.block_size - 1) / pv.block_size;
  for (int64_t i = first / pv.block_size, start = i * pv.block_size; start < ctx; start += pv.block_size, ++i) {
    if (i + 1 < blocks) {
      const int64_t n_next = std::min(pv.block_size, ctx - start - pv.block_size);
      const int64_t next = pv.table[i + 1] * pv.block_stride + head_offset;
      const int64_t stride = pv.token_stride * sizeof(C);
      prefetch_rows<3>(reinterpret_cast<const char*>(cache + next), n_next, stride, row_bytes);
      if (also) prefetch_rows<2>(reinterpret_cast<const char*>(also + next), n_next, stride, row_bytes);
    }
    const int64_t n = std::min(pv.block_size, ctx - start);
    const int64_t skip = std::max<int64_t>(first - start, 0);
    int64_t off = pv.table[i] * pv.block_stride + head_offset + skip * pv.token_stride;
    for (int64_t j = skip; j < n; ++j, off += pv.token_stride) f(start + j, off);
  }
}

#if defined(KVSERVE_V16)
// n tokens' products (parts[g][j]: token j's 16 unreduced lanes for head g) reduced together
// (sum16), scaled by the key rows' int8 scales where the cache has them, into each head's
// scores (s: the first of them, heads n_all apart).
template <typename C, int G>
inline void flush_scores(float* s, int64_t n_all, const float (&parts)[G][16][16], const float* scales, int n) {
  for (int g = 0; g < G; ++g) {
    V16 v[16];
    for (int j = 0; j < 16; ++j) v[j] = j < n ? v16_load(parts[g][j]) : v16_zero();
    V16 sums = sum16(v);
    if constexpr (kRowExtra<C> > 0) sums = sums * v16_load(scales);
    v16_store_n(s + g * n_all, sums, n);
  }
}

// The G query heads of one KV head, scores over tokens first..ctx-1 (s holds
// n = ctx - first per head): each key row
// is loaded (and converted) once for all G heads, the queries held in
// registers. Each token's G products wait, unreduced, until 16 tokens are in;
// sum16 then reduces them together. vc: the value cache to ask for ahead, or null.
template <typename C, int HD, int G>
inline void scores_v16(float* s, const float* q, const C* kc, const PagedView& pv, int64_t head_offset,
                       int64_t first, int64_t ctx, const C* vc) {
  const int64_t n_all = ctx - first;
  constexpr int kVecs = HD / 16;
  V16 qv[G][kVecs];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < kVecs; ++i) qv[g][i] = v16_load(q + g * HD + 16 * i);
  alignas(64) float parts[G][16][16];
  alignas(64) float scales[16];  // the key rows' int8 scales
  const auto flush = [&](int64_t done, int n) { flush_scores<C, G>(s + done, n_all, parts, scales, n); };
  for_each_token(kc, (HD + kRowExtra<C>) * sizeof(C), pv, head_offset, first, ctx, [&](int64_t t, int64_t off) {
    V16 k[kVecs];
    for (int i = 0; i < kVecs; ++i) k[i] = load16(kc + off + 16 * i);
    const int64_t u = t - first;  // the token's place in s
    const int j = static_cast<int>(u % 16);
    if constexpr (kRowExtra<C> > 0) scales[j] = row_scale(kc + off, HD);
    for (int g = 0; g < G; ++g) {
      V16 acc = qv[g][0] * k[0];
      for (int i = 1; i < kVecs; ++i) acc = v16_fmadd(qv[g][i], k[i], acc);
      v16_store(parts[g][j], acc);
    }
    if (j == 15) flush(u - 15, 16);
  }, vc);
  if (n_all % 16) flush(n_all - n_all % 16, static_cast<int>(n_all % 16));
}

// sum_t p[g][t] * v[t] for the G query heads, each value row loaded once and
// the accumulators held in registers (through memory, each token's add would
// wait for the previous store).
template <typename C, int HD, int G>
inline void values_v16(float* out, const float* p, const C* vc, const PagedView& pv, int64_t head_offset,
                       int64_t first, int64_t ctx) {
  const int64_t n_all = ctx - first;
  constexpr int kVecs = HD / 16;
  V16 acc[G][kVecs];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < kVecs; ++i) acc[g][i] = v16_zero();
  for_each_token(vc, (HD + kRowExtra<C>) * sizeof(C), pv, head_offset, first, ctx, [&](int64_t t, int64_t off) {
    V16 v[kVecs];
    for (int i = 0; i < kVecs; ++i) v[i] = load16(vc + off + 16 * i);
    const float vs = row_scale(vc + off, HD);
    for (int g = 0; g < G; ++g) {
      const V16 pt = v16_set1(p[g * n_all + t - first] * vs);
      for (int i = 0; i < kVecs; ++i) acc[g][i] = v16_fmadd(pt, v[i], acc[g][i]);
    }
  });
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < kVecs; ++i) v16_store(out + g * HD + 16 * i, acc[g][i]);
}

// scores_v16 and values_v16 for a pass of G heads whose queries and sums the registers do not
// hold together (AVX2 at head size 128 holds one head's: Qwen2.5's 6 heads a KV head read each
// key and value row 6 times). Each key row is loaded once for the G heads, their queries read
// from L1 and only their G sums in registers; the values 16 outputs at a time, a pass over the
// (cached) value rows for each 16. Each head's products and sums are scores_v16's and
// values_v16's operations in their order: the same bits.
template <typename C, int HD, int G>
inline void scores_wide(float* s, const float* q, const C* kc, const PagedView& pv, int64_t head_offset,
                        int64_t first, int64_t ctx, const C* vc) {
  const int64_t n_all = ctx - first;
  alignas(64) float parts[G][16][16];
  alignas(64) float scales[16];
  for_each_token(kc, (HD + kRowExtra<C>) * sizeof(C), pv, head_offset, first, ctx, [&](int64_t t, int64_t off) {
    const int64_t u = t - first;
    const int j = static_cast<int>(u % 16);
    if constexpr (kRowExtra<C> > 0) scales[j] = row_scale(kc + off, HD);
    V16 acc[G];
    const V16 k0 = load16(kc + off);
    for (int g = 0; g < G; ++g) acc[g] = v16_load(q + g * HD) * k0;
    for (int i = 1; i < HD / 16; ++i) {
      const V16 k = load16(kc + off + 16 * i);
      for (int g = 0; g < G; ++g) acc[g] = v16_fmadd(v16_load(q + g * HD + 16 * i), k, acc[g]);
    }
    for (int g = 0; g < G; ++g) v16_store(parts[g][j], acc[g]);
    if (j == 15) flush_scores<C, G>(s + u - 15, n_all, parts, scales, 16);
  }, vc);
  if (n_all % 16) flush_scores<C, G>(s + n_all - n_all % 16, n_all, parts, scales, static_cast<int>(n_all % 16));
}

template <typename C, int HD, int G>
inline void values_wide(float* out, const float* p, const C* vc, const PagedView& pv, int64_t head_offset,
                        int64_t first, int64_t ctx) {
  const int64_t n_all = ctx - first;
  for (int i = 0; i < HD / 16; ++i) {
    V16 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = v16_zero();
    for_each_token(vc, (HD + kRowExtra<C>) * sizeof(C), pv, head_offset, first, ctx, [&](int64_t t, int64_t off) {
      const V16 v = load16(vc + off + 16 * i);
      const float vs = row_scale(vc + off, HD);
      for (int g = 0; g < G; ++g) acc[g] = v16_fmadd(v16_set1(p[g * n_all + t - first] * vs), v, acc[g]);
    });
    for (int g = 0; g < G; ++g) v16_store(out + g * HD + 16 * i, acc[g]);
  }
}

// Query heads per pass over the cache: registers hold G x HD/16 query (or
// accumulator) vectors, so with AVX-512's 32 registers G <= 4 at head size 64
// and G <= 2 at 128; AVX2 has 16 registers of half the width. A head's
// arithmetic does not depend on the heads beside it.
#if defined(KVSERVE_V16_AVX512)
template <int HD>
constexpr int kMaxGroup = HD <= 64 ? 4 : 2;
#else
template <int HD>
constexpr int kMaxGroup = HD <= 64 ? 2 : 1;
#endif

// Heads a pass of scores_wide and values_wide where more than kMaxGroup share a KV head (0:
// none; AVX-512's builds keep their passes of kMaxGroup, not measured the other way).
#if defined(KVSERVE_V16_AVX512)
template <int HD>
constexpr int kWideGroup = 0;
#else
template <int HD>
constexpr int kWideGroup = HD > 64 ? 4 : 0;
#endif

// Runs f(integral_constant<G>, first_head) over the group in passes of M heads, then one of the rest.
template <int M, typename F>
inline void for_head_passes(int64_t group, F&& f) {
  int64_t g = 0;
  for (; g + M <= group; g += M) f(std::integral_constant<int, M>{}, g);
  if constexpr (M > 1) {
    if (g < group) for_head_passes<M - 1>(group - g, [&](auto heads, int64_t h) { f(heads, g + h); });
  }
}
#endif

// The ``group`` query heads sharing one KV head, for one sequence's tokens
// first..ctx-1 (all ``ctx`` but where a sliding window leaves the first out):
// scores, soft-capping (``softcap`` > 0), softmax (with the group's ``sinks``, or null),
// weighted sum of values. ``qf`` is pre-scaled.
// HD is the head size when known at compile time (0: read ``head_dim``), so
// the common sizes get fully unrolled, register-resident loops.
template <typename T, typename C, int HD>
void attend_group(T* out, const float* qf, const C* kc, const C* vc, const PagedView& pv, int64_t head_offset,
                  int64_t head_dim, int64_t group, int64_t first, int64_t ctx, float softcap, const float* sinks,
                  std::vector<float>& scores, std::vector<float>& acc) {
  const int64_t hd = HD ? HD : head_dim;
  const int64_t n = ctx - first;
  scores.resize(group * n);
  float* s = scores.data();
  acc.assign(group * hd, 0.0f);
  float* a = acc.data();
#if defined(KVSERVE_V16)
  if constexpr (HD > 0 && HD % 16 == 0) {
    // Passes of up to M heads (wide: scores_wide and values_wide's), then the softmax between.
    const auto run = [&](auto wide) {
      constexpr bool kWide = decltype(wide)::value;
      constexpr int M = kWide ? kWideGroup<HD> : kMaxGroup<HD>;
      for_head_passes<M>(group, [&](auto heads, int64_t g) {
        constexpr int G = decltype(heads)::value;
        const C* ahead = g == 0 ? vc : nullptr;
        if constexpr (kWide) scores_wide<C, HD, G>(s + g * n, qf + g * hd, kc, pv, head_offset, first, ctx, ahead);
        else scores_v16<C, HD, G>(s + g * n, qf + g * hd, kc, pv, head_offset, first, ctx, ahead);
      });
      if (softcap > 0.0f) softcap_rows(s, group * n, softcap);
      softmax_rows(s, group, n, sinks);
      for_head_passes<M>(group, [&](auto heads, int64_t g) {
        constexpr int G = decltype(heads)::value;
        if constexpr (kWide) values_wide<C, HD, G>(a + g * hd, s + g * n, vc, pv, head_offset, first, ctx);
        else values_v16<C, HD, G>(a + g * hd, s + g * n, vc, pv, head_offset, first, ctx);
      });
      for (int64_t i = 0; i < group * hd; ++i) out[i] = static_cast<T>(a[i]);
    };
    if constexpr (kWideGroup<HD> > 0) {
      if (group > kMaxGroup<HD>) return run(std::true_type{});
    }
    return run(std::false_type{});
  }
#endif
  const int64_t row_bytes = (hd + kRowExtra<C>) * sizeof(C);
  for_each_token(kc, row_bytes, pv, head_offset, first, ctx, [&](int64_t t, int64_t off) {
    const C* k = kc + off;
    const float ks = row_scale(k, hd);
    for (int64_t g = 0; g < group; ++g) s[g * n + t - first] = dot_row(qf + g * hd, k, hd) * ks;
  });
  if (softcap > 0.0f) softcap_rows(s, group * n, softcap);
  softmax_rows(s, group, n, sinks);
  for_each_token(vc, row_bytes, pv, head_offset, first, ctx, [&](int64_t t, int64_t off) {
    const C* v = vc + off;
    const float vs = row_scale(v, hd);
    for (int64_t g = 0; g < group; ++g) axpy_row(a + g * hd, s[g * n + t - first] * vs, v, hd);
  });
  for (int64_t i = 0; i < group * hd; ++i) out[i] = static_cast<T>(a[i]);
}

// The shapes both entry points read, checked: q [N, H, D] with packed heads
// (rows may be strided), out like q, caches [NB, BS, KVH, row] packed within
// each block in either order (cache_strides), one block table and context length
// per sequence, every block a context touches inside the cache.
struct PagedShapes {
  int64_t heads, head_dim, block_size, kv_heads, max_blocks;
  CacheStrides strides;
  const int64_t* tables;
  const int64_t* lens;
};

PagedShapes check_paged(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& context_lens) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q must be [N, H, D] with packed heads");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "out must be contiguous like q");
  const CacheStrides strides = cache_strides(k_cache, v_cache);
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V caches must share a dtype");
  TORCH_CHECK(block_tables.is_contiguous() && block_tables.scalar_type() == at::kLong && block_tables.dim() == 2,
              "block_tables: int64 [S, max_blocks]");
  TORCH_CHECK(context_lens.is_contiguous() && context_lens.scalar_type() == at::kLong, "context_lens: int64");
  const int64_t heads = q.size(1), head_dim = q.size(2);
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == cache_row(k_cache, head_dim) && heads % kv_heads == 0, "cache shape does not match q");
  const int64_t seqs = context_lens.numel(), max_blocks = block_tables.size(1);
  TORCH_CHECK(block_tables.size(0) == seqs, "one table and length per sequence");
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < seqs; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= max_blocks * block_size, "context length ", lens[b], " out of range");
    for (int64_t i = 0; i < (lens[b] + block_size - 1) / block_size; ++i) {
      const int64_t blk = tables[b * max_blocks + i];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "block id ", blk, " out of range");
    }
  }
  return {heads, head_dim, block_size, kv_heads, max_blocks, strides, tables, lens};
}

// The caches and shapes every token of a call shares.
template <typename T, typename C>
struct PagedCall {
  const T* q;
  int64_t q_stride;
  T* out;
  const C* kc;
  const C* vc;
  const PagedShapes& p;
  float scale;
  int64_t window;  // a sliding window's keys per query (0: all)
  float softcap;   // scores become softcap * tanh(score / softcap) (0: none)
  const float* sinks;  // one sink logit per query head (null: none)
};

// Query row `row` (its heads of KV head h) over the first ctx tokens of the
// sequence whose block table is `table` (with a sliding window, its last
// `window` of them): the one routine behind decodes and prompt chunks alike.
// qf is a per-thread buffer.
template <typename T, typename C>
void attend_token(const PagedCall<T, C>& c, int64_t row, int64_t h, const int64_t* table, int64_t ctx) {
  const int64_t first = c.window > 0 && ctx > c.window ? ctx - c.window : 0;
  const PagedShapes& p = c.p;
  const int64_t group = p.heads / p.kv_heads, d = p.head_dim;
  thread_local std::vector<float> qf, scores, acc;
  qf.resize(group * d);
  const T* src = c.q + row * c.q_stride + h * group * d;
  for (int64_t i = 0; i < group * d; ++i) qf[i] = to_f(src[i]) * c.scale;
  const PagedView pv{p.block_size, p.strides.token, p.strides.block, table};
  const int64_t head_offset = h * p.strides.head;
  T* dst = c.out + (row * p.heads + h * group) * d;
  const float cap = c.softcap;
  const float* sinks = c.sinks ? c.sinks + h * group : nullptr;
  if (d == 64) attend_group<T, C, 64>(dst, qf.data(), c.kc, c.vc, pv, head_offset, d, group, first, ctx, cap, sinks,
                                        scores, acc);
  else if (d == 128) attend_group<T, C, 128>(dst, qf.data(), c.kc, c.vc, pv, head_offset, d, group, first, ctx, cap,
                                             sinks, scores, acc);
  else attend_group<T, C, 0>(dst, qf.data(), c.kc, c.vc, pv, head_offset, d, group, first, ctx, cap, sinks, scores,
                             acc);
}

// Calls f(PagedCall<scalar_t, C>) for q's dtype and the caches' element type.
template <typename F>
void dispatch_paged(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const PagedShapes& p, double scale, int64_t window, double softcap,
                    const std::optional<at::Tensor>& sinks, F&& f) {
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: no sliding window)");
  TORCH_CHECK(softcap >= 0, "softcap must be >= 0 (0: no soft-capping)");
  TORCH_CHECK(!sinks || (sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->numel() == p.heads),
              "sinks: float32, one per query head");
  const float* sink_logits = sinks ? sinks->data_ptr<float>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    dispatch_cache_type(k_cache.scalar_type(), [&](auto cache_tag) {
      using C = decltype(cache_tag);
      f(PagedCall<scalar_t, C>{q.data_ptr<scalar_t>(), q.stride(0), out.data_ptr<scalar_t>(),
                               static_cast<const C*>(k_cache.data_ptr()), static_cast<const C*>(v_cache.data_ptr()),
                               p, static_cast<float>(scale), window, static_cast<float>(softcap), sink_logits});
    });
  });
}

}  // namespace

// One query token per sequence over its paged context, read in place (no
// gather). q [B, H, D] (rows may be strided), caches [NB, BS, KVH, D] (int8:
// [NB, BS, KVH, D + 4], each row's scale after its codes),
// block_tables [B, max_blocks] int64, context_lens [B] int64; out [B, H, D].
// The H / KVH query heads sharing a KV head are handled together so each key
// and value row is read once per sequence.
void paged_decode_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale, int64_t window, double softcap,
                            const std::optional<at::Tensor>& sinks) {
  const PagedShapes p = check_paged(out, q, k_cache, v_cache, block_tables, context_lens);
  TORCH_CHECK(context_lens.numel() == q.size(0), "one query token per sequence");
  dispatch_paged(out, q, k_cache, v_cache, p, scale, window, softcap, sinks, [&](const auto& call) {
    kvserve::parallel_chunks(q.size(0) * p.kv_heads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t b = item / p.kv_heads, h = item % p.kv_heads;
        attend_token(call, b, h, p.tables + b * p.max_blocks, p.lens[b]);
      }
    });
  });
}

// q [T, H, D] (rows may be strided) holds the query tokens of S sequences,
// sequence i's at rows query_start[i]..query_start[i+1]-1, the last of its
// context_lens[i] positions (their K/V already in the caches); caches as
// paged_decode_attention's; out [T, H, D]. Each query token attends to the
// keys up to its own position, through attend_token as a decode would. One
// work item per (token, KV head), claimed one at a time, the last tokens of
// each sequence (which see the most keys) first.
void paged_prefill_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_tables,
                             const at::Tensor& context_lens, const at::Tensor& query_start, double scale,
                             int64_t window, double softcap, const std::optional<at::Tensor>& sinks) {
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
  dispatch_paged(out, q, k_cache, v_cache, p, scale, window, softcap, sinks, [&](const auto& call) {
    kvserve::parallel_chunks(q.size(0) * p.kv_heads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t token = item / p.kv_heads, h = item % p.kv_heads;
        const int64_t i = std::upper_bound(starts, starts + seqs + 1, token) - starts - 1;
        const int64_t row = starts[i + 1] - 1 - (token - starts[i]);  // last tokens first
        attend_token(call, row, h, p.tables + i * p.max_blocks, p.lens[i] - (starts[i + 1] - 1 - row));
      }
    });
  });
}

}  // namespace kvserve

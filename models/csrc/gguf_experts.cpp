// A mixture's experts on the int8-activation GEMMs in one call a projection (llama.cpp's
// mul_mat_id): the rows of a step's (token, expert) slots, grouped by expert, each group
// against its expert's weight, every group's tiles shared out over the threads together.
// One call per expert cost a decode step of 16 sequences a dispatch, a row rounding and a
// thread fork per chosen expert and layer (about 56 of OLMoE's 64 experts a layer).
//
// A8Experts holds a layer's experts' weights for one projection (each a GGUF file's codes
// in gguf_a8.cpp's formats, row ranges as gguf_a8_linear takes them, every
// expert in the same formats and shapes), checked once when it is made; the calls then take
// the expert ids and row counts only. A slot's row is rounded to int8 as gguf_a8_linear
// rounds it and meets the same tile products (gguf_a8_tiles.h), so its result is what its
// expert's own gguf_a8_linear call gives, bit for bit, whatever else the step holds.
#include <ATen/core/Tensor.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/zeros.h>

#include "cache_rows.h"
#include "gguf_a8_tiles.h"
#include "grouped_rows.h"
#include "kernels.h"
#include "parallel.h"
#include "vec16.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace kvserve {

using grouped::kRowsInt8;
using grouped::kTile;

A8Experts::A8Experts(std::vector<at::Tensor> parts_, std::vector<int64_t> formats_, int64_t experts_,
                     int64_t in_features_, int64_t out_features_, const c10::optional<at::Tensor>& bias_)
    : parts(std::move(parts_)), bias(bias_.value_or(at::Tensor())), formats(std::move(formats_)), experts(experts_),
      in_features(in_features_), out_features(out_features_) {
  TORCH_CHECK(!bias.defined() || (bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.dim() == 2 &&
                                  bias.size(0) == experts_ && bias.size(1) == out_features_),
              "bias must be float32 [experts, out_features], contiguous");
  const int64_t segments = static_cast<int64_t>(formats.size());
  TORCH_CHECK(experts > 0 && segments > 0 && static_cast<int64_t>(parts.size()) == 2 * segments * experts,
              "one (codes, scales) pair per segment and expert");
  TORCH_CHECK(in_features % grouped::kGroup == 0, "in_features must be whole groups of 32");
  const int64_t groups = in_features / grouped::kGroup;
  for (int64_t e = 0; e < experts; ++e) {
    int64_t start = 0;
    for (int64_t s = 0; s < segments; ++s) {
      const at::Tensor& codes = parts[2 * (e * segments + s)];
      const at::Tensor& scales = parts[2 * (e * segments + s) + 1];
      const A8Segment seg = a8_segment(static_cast<size_t>(s), codes, scales, formats[s], groups);
      if (e == 0) {
        first.push_back(seg);
        columns.push_back(start);
      } else {
        TORCH_CHECK(codes.sizes() == parts[2 * s].sizes() && scales.sizes() == parts[2 * s + 1].sizes(),
                    "expert ", e, ", segment ", s, ": not the shape of expert 0's");
      }
      codes_of.push_back(seg.codes);
      scales_of.push_back(seg.scales);
      start += std::min(seg.tiles * kTile, out_features - start);
    }
    TORCH_CHECK(start == out_features, "expert ", e, "'s segments hold ", start, " rows, not ", out_features);
  }
}

namespace {

// out's rows [starts[i], starts[i + 1]) = expert ids[i]'s products with the same rows of xq, or,
// `shared`, every expert's one row with xq's row 0 (one token's slots: its row rounded once).
void run_experts(at::Tensor& out, const grouped::QuantizedRows& xq, bool shared, const A8Experts& w,
                 const std::vector<int64_t>& ids, const std::vector<int64_t>& counts, bool plain) {
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1 && out.scalar_type() == at::kFloat &&
                  out.size(1) == w.out_features, "out must be float32 [rows, out_features]");
  TORCH_CHECK(ids.size() == counts.size(), "one row count per expert id");
  const int64_t segments = static_cast<int64_t>(w.formats.size()), groups = w.in_features / grouped::kGroup;
  std::vector<int64_t> starts(ids.size() + 1, 0);
  for (size_t i = 0; i < ids.size(); ++i) {
    TORCH_CHECK(ids[i] >= 0 && ids[i] < w.experts && counts[i] >= 0, "expert ", ids[i], " with ", counts[i], " rows");
    TORCH_CHECK(!shared || counts[i] == 1, "a shared row is one slot an expert");
    starts[i + 1] = starts[i] + counts[i];
  }
  TORCH_CHECK(starts.back() == out.size(0), "the experts' row counts add to ", starts.back(),
              shared ? ", the slots are " : ", x has ", out.size(0));
  // (segment, tile) of each of an expert's tiles, in column order.
  std::vector<std::pair<int64_t, int64_t>> tiles;
  for (int64_t s = 0; s < segments; ++s) {
    for (int64_t t = 0; t < w.first[s].tiles; ++t) tiles.emplace_back(s, t);
  }
  const int64_t per_expert = static_cast<int64_t>(tiles.size());
  float* yp = out.data_ptr<float>();
  const int64_t ys = out.stride(0);
  const float* bias = w.bias.defined() ? w.bias.data_ptr<float>() : nullptr;
  // Items expert-major: a thread's share is whole experts' weights, front to back.
  parallel_chunks(static_cast<int64_t>(ids.size()) * per_expert, grouped::kTileGrain, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / per_expert, e = ids[i];
      const auto [s, t] = tiles[item % per_expert];
      A8Segment seg = w.first[s];
      seg.codes = w.codes_of[e * segments + s];
      seg.scales = w.scales_of[e * segments + s];
      const int64_t column = w.columns[s] + t * kTile;
      const int64_t valid = std::min(kTile, (s + 1 < segments ? w.columns[s + 1] : w.out_features) - column);
      const bool once = starts[i + 1] - starts[i] <= kRowsInt8;  // (one pass over the tile)
      for (int64_t r = starts[i]; r < starts[i + 1]; r += kRowsInt8) {
        const int rows = static_cast<int>(std::min<int64_t>(kRowsInt8, starts[i + 1] - r));
        a8_tile(seg, t, yp + r * ys + column, ys, xq, shared ? 0 : r, rows, groups, valid, plain, once);
      }
      if (bias) {  // (each product rounded first, then one add: torch's y + bias)
        const float* b = bias + e * w.out_features + column;
        for (int64_t r = starts[i]; r < starts[i + 1]; ++r) {
          for (int64_t c = 0; c < valid; ++c) yp[r * ys + column + c] += b[c];
        }
      }
    }
  });
}

}  // namespace

void gguf_a8_experts(at::Tensor& out, const at::Tensor& x, const A8Experts& w, const std::vector<int64_t>& ids,
                     const std::vector<int64_t>& counts, bool plain) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat && x.size(1) == w.in_features,
              "x must be float32 [rows, in_features]");
  TORCH_CHECK(out.size(0) == x.size(0), "out must have x's rows");
  const grouped::QuantizedRows xq = grouped::quantize_rows(x.data_ptr<float>(), x.size(0), x.stride(0),
                                                           w.in_features / grouped::kGroup, 0.0f, x.size(0));
  run_experts(out, xq, false, w, ids, counts, plain);
}

namespace {

// Row r of mix_expert_rows. NOTE: without contraction: the build's default would fuse a
// product into the add after it (one rounding where torch has two).
__attribute__((optimize("fp-contract=off"))) void mix_row(float* y, const float* o, const int64_t* idx,
                                                         const float* w, int64_t k, int64_t h) {
  const float* o0 = o + idx[0] * h;
  const float w0 = w[0];
  if (k == 1) {
    for (int64_t i = 0; i < h; ++i) y[i] = o0[i] * w0;
    return;
  }
  const float* o1 = o + idx[1] * h;
  const float w1 = w[1];
  for (int64_t i = 0; i < h; ++i) {
    const float p0 = o0[i] * w0, p1 = o1[i] * w1;
    y[i] = p0 + p1;
  }
  for (int64_t j = 2; j < k; ++j) {
    const float* oj = o + idx[j] * h;
    const float wj = w[j];
    for (int64_t i = 0; i < h; ++i) {
      const float p = oj[i] * wj;
      y[i] = y[i] + p;
    }
  }
}

}  // namespace

// y[t] = the sum over j of out[index[t k + j]] * weights[t, j]: each product rounded to float,
// the first two added, then each next in j's order, as torch's (out * w).unbind(1) and adds
// give them, so the same bits (no multiply-add: the products are rounded first). A slot's row
// is read where its expert's rows left it, with no un-permuting copy of every slot.
void mix_expert_rows(at::Tensor& y, const at::Tensor& out, const at::Tensor& index, const at::Tensor& weights) {
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.is_contiguous() && y.dim() == 2, "y must be float32 [T, H]");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 && out.size(1) == y.size(1),
              "out must be float32 [S, H]");
  TORCH_CHECK(weights.scalar_type() == at::kFloat && weights.is_contiguous() && weights.dim() == 2 &&
                  weights.size(0) == y.size(0) && weights.size(1) >= 1, "weights must be float32 [T, k]");
  const int64_t t = y.size(0), h = y.size(1), k = weights.size(1);
  TORCH_CHECK(index.scalar_type() == at::kLong && index.is_contiguous() && index.numel() == t * k,
              "index must be int64 [T * k]");
  const int64_t* idx = index.data_ptr<int64_t>();
  for (int64_t i = 0; i < t * k; ++i) {
    TORCH_CHECK(idx[i] >= 0 && idx[i] < out.size(0), "slot ", i, "'s row out of range");
  }
  const float* o = out.data_ptr<float>();
  const float* w = weights.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  parallel_chunks(t, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) mix_row(yp + r * h, o, idx + r * k, w + r * k, k, h);
  });
}

// y[s] += B_e (A_e x[s]) for each row s of expert[s] = e >= 0 (-1: none): a [E, r, K] and
// bt [E, r, N] float32 (B transposed, the adapter's scale in it). The r dots of A_e's rows
// with x[s] (cache_rows.h dot_row), then per output the sum over j of t_j bt[e, j, i] in j's
// order (a product, then fused multiply-adds), added to y[s] once: a row's update depends on
// that row alone, never on the others or on how many there are.
void lora_expert_rows(at::Tensor& y, const at::Tensor& x, const at::Tensor& expert, const at::Tensor& a,
                      const at::Tensor& bt) {
  TORCH_CHECK(a.scalar_type() == at::kFloat && a.is_contiguous() && a.dim() == 3, "a must be float32 [E, r, K]");
  TORCH_CHECK(bt.scalar_type() == at::kFloat && bt.is_contiguous() && bt.dim() == 3 && bt.size(0) == a.size(0) &&
                  bt.size(1) == a.size(1), "bt must be float32 [E, r, N], a's E and r");
  const int64_t rows = x.size(0), k = a.size(2), r = a.size(1), n = bt.size(2), experts = a.size(0);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1 && x.size(1) == k,
              "x must be float32 [rows, K]");
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.dim() == 2 && y.stride(1) == 1 && y.size(0) == rows &&
                  y.size(1) == n, "y must be float32 [rows, N]");
  TORCH_CHECK(expert.scalar_type() == at::kLong && expert.is_contiguous() && expert.numel() == rows,
              "expert must be int64 [rows]");
  TORCH_CHECK(r >= 1, "a rank of at least 1");
  const int64_t* ep = expert.data_ptr<int64_t>();
  for (int64_t s = 0; s < rows; ++s) TORCH_CHECK(ep[s] >= -1 && ep[s] < experts, "row ", s, "'s expert ", ep[s]);
  const float* xp = x.data_ptr<float>();
  const float* ap = a.data_ptr<float>();
  const float* bp = bt.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t xs = x.stride(0), ys = y.stride(0);
  parallel_chunks(rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> t(static_cast<size_t>(r)), acc(static_cast<size_t>(n));
    for (int64_t s = begin; s < end; ++s) {
      const int64_t e = ep[s];
      if (e < 0) continue;
      for (int64_t j = 0; j < r; ++j) t[j] = dot_row(ap + (e * r + j) * k, xp + s * xs, k);
      const float* b = bp + e * r * n;
      int64_t i = 0;
#if defined(KVSERVE_V16)
      for (; i + 16 <= n; i += 16) {
        V16 sum = v16_set1(t[0]) * v16_load(b + i);
        for (int64_t j = 1; j < r; ++j) sum = v16_fmadd(v16_set1(t[j]), v16_load(b + j * n + i), sum);
        v16_store(acc.data() + i, sum);
      }
#endif
      for (; i < n; ++i) {
        float sum = t[0] * b[i];
        for (int64_t j = 1; j < r; ++j) sum = std::fma(t[j], b[j * n + i], sum);
        acc[i] = sum;
      }
      float* row = yp + s * ys;
      for (i = 0; i < n; ++i) row[i] += acc[i];
    }
  });
}

namespace {

// The k largest of v[0, n) (ties: the lower index first), largest first, into top.
void top_k(const float* v, int64_t n, int64_t k, int64_t* top) {
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t i = 0; i < n; ++i) {
      if (std::find(top, top + j, i) != top + j) continue;
      // (a NaN never wins a comparison: the first index not taken stands)
      if (best < 0 || v[i] > v[best]) best = i;
    }
    top[j] = best;
  }
}

}  // namespace

// Each row of logits [T, E] (float32) -> its k experts and their weights, by the router `kind`
// (RouterKind), the pairs in ascending expert id (the order mix_expert_rows adds them in).
// One pass of plain float arithmetic a row (expf, sums in a fixed order), so a row's choice
// and weights do not depend on the other rows or the build.
std::vector<at::Tensor> route_experts(const at::Tensor& logits, int64_t k, int64_t kind) {
  TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.dim() == 2 && logits.is_contiguous(),
              "logits must be float32 [T, E], contiguous");
  const int64_t t = logits.size(0), e = logits.size(1);
  TORCH_CHECK(k >= 1 && k <= e, "experts per token ", k, " not in [1, ", e, "]");
  TORCH_CHECK(kind >= kSoftmaxTopK && kind <= kTopKSoftmax, "unknown router kind ", kind);
  at::Tensor weights = at::empty({t, k}, logits.options());
  at::Tensor chosen = at::empty({t, k}, logits.options().dtype(at::kLong));
  const float* lp = logits.data_ptr<float>();
  float* wp = weights.data_ptr<float>();
  int64_t* cp = chosen.data_ptr<int64_t>();
  std::vector<float> p(static_cast<size_t>(e));
  std::vector<int64_t> top(static_cast<size_t>(k));
  std::vector<float> w(static_cast<size_t>(k));
  for (int64_t r = 0; r < t; ++r) {
    const float* l = lp + r * e;
    if (kind == kTopKSoftmax) {
      top_k(l, e, k, top.data());
      float sum = 0.0f;
      for (int64_t j = 0; j < k; ++j) sum += w[j] = std::exp(l[top[j]] - l[top[0]]);
      for (int64_t j = 0; j < k; ++j) w[j] /= sum;
    } else {
      const float m = *std::max_element(l, l + e);
      float sum = 0.0f;
      for (int64_t i = 0; i < e; ++i) sum += p[i] = std::exp(l[i] - m);
      for (int64_t i = 0; i < e; ++i) p[i] /= sum;
      top_k(p.data(), e, k, top.data());
      float chosen_sum = 0.0f;
      for (int64_t j = 0; j < k; ++j) chosen_sum += w[j] = p[top[j]];
      if (kind == kSoftmaxTopKNorm) {
        for (int64_t j = 0; j < k; ++j) w[j] /= chosen_sum;
      }
    }
    std::vector<int64_t> by_id(static_cast<size_t>(k));
    for (int64_t j = 0; j < k; ++j) by_id[j] = j;
    std::sort(by_id.begin(), by_id.end(), [&](int64_t a, int64_t b) { return top[a] < top[b]; });
    for (int64_t j = 0; j < k; ++j) {
      cp[r * k + j] = top[by_id[j]];
      wp[r * k + j] = w[by_id[j]];
    }
  }
  return {weights, chosen};
}

// y [T, H] = each token's chosen experts (chosen [T, k], each row ascending) on its row of
// x [T, H], their outputs scaled by weights [T, k] and added (mix_expert_rows): gate_up (its
// biases added, where it has them), `activation`, then down (likewise). The slots are grouped by expert with
// a stable counting sort (torch's stable argsort of the flat choices, the same order), each
// slot's input row is its token's row, and both projections run every expert's rows in one
// call. Also returns the tokens routed to each expert (int64 [E]).
namespace {

// y's rows (in expert order: row_expert, row_token each row's) plus each adapter's update of
// the projection at lora[6 g + which] (a, bt, has) for the rows of its tokens (owner).
void add_expert_lora(at::Tensor& y, const at::Tensor& x, const std::vector<at::Tensor>& lora, size_t which,
                     const int64_t* owner, const std::vector<int64_t>& row_expert,
                     const std::vector<int64_t>& row_token) {
  const int64_t rows = static_cast<int64_t>(row_expert.size());
  for (size_t g = 0; 6 * g < lora.size(); ++g) {
    const at::Tensor& a = lora[6 * g + which];
    if (a.numel() == 0) continue;
    const at::Tensor& has = lora[6 * g + which + 2];
    TORCH_CHECK(has.scalar_type() == at::kBool && has.is_contiguous() && has.numel() == a.size(0),
                "an adapter's experts: bool [E]");
    const bool* hp = has.data_ptr<bool>();
    at::Tensor sel = at::empty({rows}, y.options().dtype(at::kLong));
    int64_t* sp = sel.data_ptr<int64_t>();
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t e = row_expert[r];
      sp[r] = owner[row_token[r]] == static_cast<int64_t>(g) && hp[e] ? e : -1;
    }
    lora_expert_rows(y, x, sel, a, lora[6 * g + which + 1]);
  }
}

}  // namespace

std::vector<at::Tensor> moe_experts(const at::Tensor& x, const A8Experts& gate_up, const A8Experts& down,
                                    const at::Tensor& weights, const at::Tensor& chosen, int64_t activation,
                                    double limit, double alpha, const std::vector<at::Tensor>& lora,
                                    const c10::optional<at::Tensor>& lora_owner) {
  TORCH_CHECK(lora.size() % 6 == 0 && (lora.empty() || lora_owner.has_value()),
              "six tensors an adapter, and each token's adapter");
  TORCH_CHECK(activation == kSiluGlu || activation == kGeluTanhGlu || (activation == kClampedSwiGlu && alpha != 0.0),
              "unknown activation ",
              activation, " (alpha ", alpha, ")");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1 && x.size(1) == gate_up.in_features,
              "x must be float32 [T, in_features]");
  TORCH_CHECK(chosen.scalar_type() == at::kLong && chosen.is_contiguous() && chosen.dim() == 2 &&
                  chosen.size(0) == x.size(0), "chosen must be int64 [T, k]");
  TORCH_CHECK(gate_up.experts == down.experts && down.in_features * 2 == gate_up.out_features &&
                  down.out_features == x.size(1), "gate_up and down must be one layer's experts");
  const int64_t t = x.size(0), k = chosen.size(1), slots = t * k, experts = gate_up.experts, h = x.size(1);
  const int64_t* cp = chosen.data_ptr<int64_t>();
  at::Tensor routed = at::zeros({experts}, chosen.options());
  int64_t* counts = routed.data_ptr<int64_t>();
  for (int64_t s = 0; s < slots; ++s) {
    TORCH_CHECK(cp[s] >= 0 && cp[s] < experts, "expert ", cp[s], " out of range");
    counts[cp[s]] += 1;
  }
  std::vector<int64_t> ids, rows_of, next(static_cast<size_t>(experts));
  for (int64_t e = 0, start = 0; e < experts; start += counts[e], ++e) {
    next[e] = start;
    if (counts[e] > 0) {
      ids.push_back(e);
      rows_of.push_back(counts[e]);
    }
  }
  // Slot s's rows are at index[s] in expert order; each row is its token's input. One token (a
  // decode of one sequence) is rounded once and read by every slot; more are copied per slot.
  at::Tensor index = at::empty({slots}, chosen.options());
  int64_t* ip = index.data_ptr<int64_t>();
  at::Tensor both = at::empty({slots, gate_up.out_features}, x.options());
  at::Tensor rows;  // each row's input (one token: x's row, read by every row)
  if (t == 1) {
    for (int64_t s = 0; s < slots; ++s) ip[s] = next[cp[s]]++;
    const grouped::QuantizedRows xq =
        grouped::quantize_rows(x.data_ptr<float>(), 1, x.stride(0), h / grouped::kGroup, 0.0f, 1);
    run_experts(both, xq, true, gate_up, ids, rows_of, false);
    rows = x.narrow(0, 0, 1).expand({slots, h});
  } else {
    rows = at::empty({slots, h}, x.options());
    const float* xp = x.data_ptr<float>();
    float* rp = rows.data_ptr<float>();
    for (int64_t s = 0; s < slots; ++s) {
      const int64_t at_row = ip[s] = next[cp[s]]++;
      std::copy(xp + (s / k) * x.stride(0), xp + (s / k) * x.stride(0) + h, rp + at_row * h);
    }
    gguf_a8_experts(both, rows, gate_up, ids, rows_of, false);
  }
  std::vector<int64_t> row_expert, row_token;
  const int64_t* owner = nullptr;
  if (!lora.empty()) {  // (models/experts.py FusedExperts with _add_lora: the same calls, the same bits)
    TORCH_CHECK(lora_owner->scalar_type() == at::kLong && lora_owner->is_contiguous() && lora_owner->numel() == t,
                "lora_owner must be int64 [T]");
    owner = lora_owner->data_ptr<int64_t>();
    row_expert.resize(static_cast<size_t>(slots));
    row_token.resize(static_cast<size_t>(slots));
    for (int64_t s = 0; s < slots; ++s) {
      row_expert[ip[s]] = cp[s];
      row_token[ip[s]] = s / k;
    }
    add_expert_lora(both, rows, lora, 0, owner, row_expert, row_token);
  }
  at::Tensor act = at::empty({slots, down.in_features}, x.options());
  if (activation == kClampedSwiGlu) {
    // models/moe.py ClampedSwiGLUExpert.activate's torch ops, in its order: the same bits.
    const int64_t inter = down.in_features;
    const at::Tensor gate = both.narrow(1, 0, inter).clamp(c10::nullopt, limit), up = both.narrow(1, inter, inter);
    silu_and_mul(act, at::cat({gate.mul(alpha), up.clamp(-limit, limit).add(1)}, 1));
    act.div_(alpha);
  } else if (activation == kGeluTanhGlu) {
    // models/gemma.py GemmaMLP.activate's torch ops on the same views: the same bits.
    const int64_t inter = down.in_features;
    at::mul_out(act, at::gelu(both.narrow(1, 0, inter), "tanh"), both.narrow(1, inter, inter));
  } else {
    silu_and_mul(act, both);
  }
  at::Tensor out = at::empty({slots, h}, x.options());
  gguf_a8_experts(out, act, down, ids, rows_of, false);
  if (owner != nullptr) add_expert_lora(out, act, lora, 3, owner, row_expert, row_token);
  at::Tensor y = at::empty({t, h}, x.options());
  mix_expert_rows(y, out, index, weights.contiguous());
  return {y, routed};
}

}  // namespace kvserve

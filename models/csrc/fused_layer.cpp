// One whole decoder layer in one call, from the kernels of the other files.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/sigmoid.h>

#include "grouped_gemm.h"
#include "kernels.h"

#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

namespace kvserve {
namespace {

// Projection p's LoRA updates (p: 0 qkv, 1 o, 2 gate_up, 3 down) added to its output:
// y[start:stop] += (x[start:stop] @ A^T) @ B^T for each adapter's row range
// (lora_rows: start, stop pairs; lora: per range, (A, B) per projection, dense_linear's
// packing, the scale in B; an empty A where the adapter leaves p alone). The
// same dense_linear calls and in-place add as the op-by-op layer's LoRABatch.add, so
// a row gets the same bits on either path.
void add_lora(at::Tensor& y, const at::Tensor& x, const std::vector<at::Tensor>& lora,
              const std::vector<int64_t>& lora_rows, int p) {
  for (size_t i = 0; i < lora_rows.size() / 2; ++i) {
    const at::Tensor& a = lora[8 * i + 2 * p];
    const at::Tensor& b = lora[8 * i + 2 * p + 1];
    if (a.numel() == 0) continue;
    const int64_t start = lora_rows[2 * i], len = lora_rows[2 * i + 1] - start;
    at::Tensor t = at::empty({len, b.size(1)}, x.options());  // b [out/16, rank, 16]
    dense_linear(t, x.narrow(0, start, len), a);
    at::Tensor u = at::empty({len, y.size(1)}, y.options());
    dense_linear(u, t, b);
    y.narrow(0, start, len).add_(u);
  }
}

// y = x @ W^T for projection p by `gemm` (models/ops/layer.py GEMM_*): grouped_linear's codes
// and scales, float or int8 activations; amx_bf16_linear's bfloat16 B operands (codes
// only); amx_w4a16_linear's 4-bit codes and scales; or amx_quant_linear's segments.
void project(at::Tensor& y, const at::Tensor& x, const std::vector<at::Tensor>& p, int64_t gemm) {
  switch (gemm) {
    case kGemmGrouped:
    case kGemmGroupedInt8: grouped_linear(y, x, p[0], p[1], gemm == kGemmGroupedInt8, false); break;
    case kGemmAmxBf16: amx_bf16_linear(y, x, p[0]); break;
    case kGemmAmxW4a16: amx_w4a16_linear(y, x, p[0], p[1]); break;
    case kGemmAmxQuant: {
      const at::Tensor& f = p.back();
      TORCH_CHECK(f.scalar_type() == at::kLong && f.is_contiguous(), "the last tensor holds the formats (int64)");
      const std::vector<int64_t> formats(f.data_ptr<int64_t>(), f.data_ptr<int64_t>() + f.numel());
      amx_quant_linear(y, x, std::vector<at::Tensor>(p.begin(), p.end() - 1), formats);
      break;
    }
    case kGemmA8Quant: {
      const at::Tensor& f = p.back();
      TORCH_CHECK(f.scalar_type() == at::kLong && f.is_contiguous(), "the last tensor holds the formats (int64)");
      const std::vector<int64_t> formats(f.data_ptr<int64_t>(), f.data_ptr<int64_t>() + f.numel());
      gguf_a8_linear(y, x, std::vector<at::Tensor>(p.begin(), p.end() - 1), formats, false);
      break;
    }
    default: TORCH_CHECK(false, "unknown projection GEMM ", gemm);
  }
}

// A layer's query and key heads RMS-normalised in qkv [T, width] before RoPE, in place, as the
// op-by-op layers do (each normalised row through rms_norm's row routine): q_norm and k_norm of
// head_dim values normalise each head (Qwen3), of the whole projection's width the whole
// projection (OLMoE). Undefined tensors: no norm.
void norm_heads(at::Tensor& qkv, const at::Tensor& q_norm, const at::Tensor& k_norm, int64_t q_size,
                int64_t kv_size, double eps) {
  if (!q_norm.defined()) return;
  const int64_t rows = qkv.size(0), width = qkv.size(1);
  for (const auto& [weight, start, size] : {std::make_tuple(q_norm, int64_t{0}, q_size),
                                            std::make_tuple(k_norm, q_size, kv_size)}) {
    const int64_t n = weight.numel();
    TORCH_CHECK(size % n == 0, "a q/k norm of ", n, " values for ", size, " features");
    at::Tensor pieces = qkv.as_strided({rows, size / n, n}, {width, n, 1}, qkv.storage_offset() + start);
    rms_norm_pieces(pieces, weight, eps);
  }
}

// What a step's layers share, with this layer's caches.
struct LayerStep {
  const StepArgs& args;
  at::Tensor& k_cache;
  at::Tensor& v_cache;
};

// The attention's output for h, the input norm's output: qkv (its bias, LoRA), the q/k norms,
// RoPE and the cache write, attention, o_proj (its bias, LoRA).
at::Tensor attention(const at::Tensor& h, const LayerArgs& w, const LayerStep& ls, const std::vector<at::Tensor>& lora,
                     const std::vector<int64_t>& lora_rows) {
  const StepArgs& step = ls.args;
  const int64_t rows = h.size(0), hidden = h.size(1);
  const int64_t head_dim = step.rotations.size(1) * 2;
  const int64_t q_size = w.num_heads * head_dim, kv_size = w.num_kv_heads * head_dim;
  const auto opts = h.options();
  at::Tensor qkv_out = at::empty({rows, q_size + 2 * kv_size}, opts);
  project(qkv_out, h, w.qkv, w.gemm);
  if (w.qkv_bias.has_value()) qkv_out.add_(*w.qkv_bias);
  add_lora(qkv_out, h, lora, lora_rows, 0);
  norm_heads(qkv_out, w.q_norm, w.k_norm, q_size, kv_size, w.eps);
  rotary_and_cache(qkv_out, step.rotations, step.positions, ls.k_cache, ls.v_cache, step.slot_mapping,
                   w.num_heads, w.num_kv_heads);
  const at::Tensor q = qkv_out.narrow(1, 0, q_size).view({rows, w.num_heads, head_dim});
  at::Tensor attn = at::empty({rows, w.num_heads, head_dim}, opts);
  if (!step.prefill_query_start.has_value()) {
    paged_decode_attention(attn, q, ls.k_cache, ls.v_cache, step.block_tables, step.context_lens, w.scale,
                           w.window, w.softcap, w.sinks);
  } else {
    const int64_t seqs = step.context_lens.numel(), d = step.num_decodes;
    TORCH_CHECK(d >= 0 && d < seqs && d < rows, "num_decodes ", d, " out of range");
    if (d > 0) {
      at::Tensor head = attn.narrow(0, 0, d);
      paged_decode_attention(head, q.narrow(0, 0, d), ls.k_cache, ls.v_cache, step.block_tables.narrow(0, 0, d),
                             step.context_lens.narrow(0, 0, d), w.scale, w.window, w.softcap, w.sinks);
    }
    at::Tensor tail = attn.narrow(0, d, rows - d);
    paged_prefill_attention(tail, q.narrow(0, d, rows - d), ls.k_cache, ls.v_cache,
                            step.block_tables.narrow(0, d, seqs - d), step.context_lens.narrow(0, d, seqs - d),
                            *step.prefill_query_start, w.scale, w.window, w.softcap, w.sinks);
  }
  at::Tensor o = at::empty({rows, hidden}, opts);
  const at::Tensor attn_rows = attn.view({rows, q_size});
  project(o, attn_rows, w.o_proj, w.gemm);
  if (w.o_bias.has_value()) o.add_(*w.o_bias);  // (before LoRA's update, as the op-by-op layer adds them)
  add_lora(o, attn_rows, lora, lora_rows, 1);
  return o;
}

// The layer up to its MLP: (h, residual), h the post-attention norm's output for the MLP.
// residual_multiplier: the attention's output scaled by it (Granite; 1: not).
std::pair<at::Tensor, at::Tensor> attention_half(const at::Tensor& x, const c10::optional<at::Tensor>& residual_in,
                                                 const LayerArgs& w, const LayerStep& step,
                                                 const std::vector<at::Tensor>& lora,
                                                 const std::vector<int64_t>& lora_rows,
                                                 double residual_multiplier = 1.0) {
  at::Tensor h = at::empty_like(x);
  at::Tensor residual;
  if (residual_in.has_value()) {
    residual = *residual_in;
    add_rms_norm(h, residual, x, w.input_norm, w.eps);
  } else {
    residual = x;
    rms_norm(h, x, w.input_norm, w.eps);
  }
  at::Tensor o = attention(h, w, step, lora, lora_rows);
  if (residual_multiplier != 1.0) o.mul_(residual_multiplier);
  add_rms_norm(h, residual, o, w.post_norm, w.eps);
  return {h, residual};
}

// rms_norm(x) into a new tensor.
at::Tensor normed(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor out = at::empty_like(x);
  rms_norm(out, x, weight, eps);
  return out;
}

// A gated MLP's output for h: gate_up, silu(gate) * up (gelu_tanh: Gemma's gelu(gate, tanh) *
// up, its torch ops), down, each projection with its LoRA updates (add_lora: p 2 and 3).
at::Tensor mlp(const at::Tensor& h, const std::vector<at::Tensor>& gate_up, const std::vector<at::Tensor>& down,
               int64_t gemm, const std::vector<at::Tensor>& lora, const std::vector<int64_t>& lora_rows,
               bool gelu_tanh = false) {
  const int64_t rows = h.size(0), hidden = h.size(1);
  const auto opts = h.options();
  // down's input width = the intermediate size (its 32-input groups or blocks)
  const int64_t inter = down[0].size(1) * 32;
  at::Tensor gu = at::empty({rows, 2 * inter}, opts);
  project(gu, h, gate_up, gemm);
  add_lora(gu, h, lora, lora_rows, 2);
  at::Tensor act;
  if (gelu_tanh) {  // (models/gemma.py GemmaMLP.activate: chunk, F.gelu(gate, approximate="tanh") * up)
    act = at::gelu(gu.narrow(1, 0, inter), "tanh").mul(gu.narrow(1, inter, inter));
  } else {
    act = at::empty({rows, inter}, opts);
    silu_and_mul(act, gu);
  }
  at::Tensor out = at::empty({rows, hidden}, opts);
  project(out, act, down, gemm);
  add_lora(out, act, lora, lora_rows, 3);
  return out;
}

// The LoRA arguments add_lora reads: (A, B) of 4 projections per (start, stop) row range.
void check_lora(const std::vector<at::Tensor>& lora, const std::vector<int64_t>& lora_rows) {
  TORCH_CHECK(lora_rows.size() % 2 == 0 && lora.size() == 4 * lora_rows.size(),
              "lora: (A, B) of 4 projections per (start, stop) row range");
}

void check_segments(const std::vector<const std::vector<at::Tensor>*>& projections, int64_t gemm) {
  const bool segments = gemm == kGemmAmxQuant || gemm == kGemmA8Quant;
  for (const auto* p : projections)
    TORCH_CHECK(segments ? p->size() % 2 == 1 : p->size() == 2,
                "each projection is (codes, scales), or for kGemmAmxQuant and kGemmA8Quant its segments' and the "
                "formats");
}

}  // namespace

LayerArgs::LayerArgs(at::Tensor input_norm, at::Tensor post_norm, double eps, std::vector<at::Tensor> qkv,
                     c10::optional<at::Tensor> qkv_bias, c10::optional<at::Tensor> q_norm,
                     c10::optional<at::Tensor> k_norm, std::vector<at::Tensor> o_proj, c10::optional<at::Tensor> o_bias,
                     std::vector<at::Tensor> gate_up, std::vector<at::Tensor> down, int64_t num_heads,
                     int64_t num_kv_heads, double scale, int64_t window, double softcap,
                     c10::optional<at::Tensor> sinks, int64_t gemm, c10::optional<at::Tensor> pre_ff_norm,
                     c10::optional<at::Tensor> post_ff_norm)
    : input_norm(std::move(input_norm)), post_norm(std::move(post_norm)), eps(eps), qkv(std::move(qkv)),
      qkv_bias(std::move(qkv_bias)), q_norm(q_norm.value_or(at::Tensor())), k_norm(k_norm.value_or(at::Tensor())),
      o_proj(std::move(o_proj)), o_bias(std::move(o_bias)), gate_up(std::move(gate_up)), down(std::move(down)),
      num_heads(num_heads), num_kv_heads(num_kv_heads), scale(scale), window(window), softcap(softcap),
      sinks(std::move(sinks)), gemm(gemm), pre_ff_norm(pre_ff_norm.value_or(at::Tensor())),
      post_ff_norm(post_ff_norm.value_or(at::Tensor())) {
  check_segments({&this->qkv, &this->o_proj}, gemm);
  if (!this->gate_up.empty() || !this->down.empty()) check_segments({&this->gate_up, &this->down}, gemm);
  TORCH_CHECK(this->pre_ff_norm.defined() == this->post_ff_norm.defined(), "Gemma's MLP norms come as a pair");
}

ExpertsArgs::ExpertsArgs(at::Tensor router, c10::optional<at::Tensor> router_bias, std::shared_ptr<A8Experts> gate_up,
                         std::shared_ptr<A8Experts> down, int64_t experts_per_token, int64_t router_kind,
                         int64_t activation, double limit, double alpha, std::vector<at::Tensor> shared_gate_up,
                         std::vector<at::Tensor> shared_down, c10::optional<at::Tensor> shared_gate,
                         double residual_multiplier, int64_t gemm)
    : router(std::move(router)), router_bias(std::move(router_bias)), gate_up(std::move(gate_up)),
      down(std::move(down)), experts_per_token(experts_per_token), router_kind(router_kind), activation(activation),
      limit(limit), alpha(alpha), shared_gate_up(std::move(shared_gate_up)), shared_down(std::move(shared_down)),
      shared_gate(std::move(shared_gate)), residual_multiplier(residual_multiplier) {
  TORCH_CHECK(this->gate_up && this->down, "the experts' gate_up and down projections");
  // (dense_linear checks the router against the experts' count)
  if (this->shared_gate.has_value()) check_segments({&this->shared_gate_up, &this->shared_down}, gemm);
}

// The batch: num_decodes decodes (one token per sequence), then, when
// step.prefill_query_start is given, prompt chunks (rows num_decodes + its offsets, the
// sequences after the decodes in block_tables and context_lens).
std::vector<at::Tensor> fused_layer(const at::Tensor& x, const c10::optional<at::Tensor>& residual_in,
                                    const LayerArgs& w, const StepArgs& step, at::Tensor& k_cache,
                                    at::Tensor& v_cache, const std::vector<at::Tensor>& lora,
                                    const std::vector<int64_t>& lora_rows) {
  TORCH_CHECK(!w.gate_up.empty() && !w.down.empty(), "a dense layer's MLP projections");
  check_lora(lora, lora_rows);
  auto [h, residual] = attention_half(x, residual_in, w, LayerStep{step, k_cache, v_cache}, lora, lora_rows);
  return {mlp(h, w.gate_up, w.down, w.gemm, lora, lora_rows), residual};
}

// The attention half as fused_layer's, then the experts the router chooses (route_experts,
// moe_experts with e.activation and the adapters' updates of the experts, expert_lora and
// expert_owner), a gated shared expert where e has one, both branches scaled by
// e.residual_multiplier: the calls the op-by-op MoE layer makes, in one call.
std::vector<at::Tensor> fused_moe_layer(const at::Tensor& x, const c10::optional<at::Tensor>& residual_in,
                                        const LayerArgs& w, const ExpertsArgs& e, const StepArgs& step,
                                        at::Tensor& k_cache, at::Tensor& v_cache, const std::vector<at::Tensor>& lora,
                                        const std::vector<int64_t>& lora_rows,
                                        const std::vector<at::Tensor>& expert_lora,
                                        const c10::optional<at::Tensor>& expert_owner) {
  check_lora(lora, lora_rows);
  for (size_t i = 0; i < lora_rows.size() / 2; ++i)  // (a sparse layer's MLP updates: its shared expert's)
    TORCH_CHECK(e.shared_gate.has_value() || (lora[8 * i + 4].numel() == 0 && lora[8 * i + 6].numel() == 0),
                "a sparse layer without a shared expert takes no MLP update");
  auto [h, residual] = attention_half(x, residual_in, w, LayerStep{step, k_cache, v_cache}, lora, lora_rows,
                                      e.residual_multiplier);
  at::Tensor logits = at::empty({x.size(0), e.gate_up->experts}, x.options());
  dense_linear(logits, h, e.router);
  if (e.router_bias.has_value()) logits.add_(*e.router_bias);
  const std::vector<at::Tensor> routed = route_experts(logits, e.experts_per_token, e.router_kind);
  std::vector<at::Tensor> mixed = moe_experts(h, *e.gate_up, *e.down, routed[0], routed[1], e.activation, e.limit,
                                              e.alpha, expert_lora, expert_owner);
  at::Tensor out = mixed[0];
  if (e.shared_gate.has_value()) {
    // models/moe.py SparseMoeBlock.forward's y + _sigmoid(shared_expert_gate(h)) * shared_expert(h), the
    // same calls: the gate's sigmoid on a strided view (torch's scalar loop, whatever the row's place).
    const int64_t rows = x.size(0);
    at::Tensor g = at::empty({rows, 1}, x.options());
    dense_linear(g, h, *e.shared_gate);
    const at::Tensor s = at::sigmoid(g.expand({rows, 2}).contiguous().select(1, 0)).unsqueeze(1);
    out = out.add(s.mul(mlp(h, e.shared_gate_up, e.shared_down, w.gemm, lora, lora_rows)));
  }
  if (e.residual_multiplier != 1.0) out.mul_(e.residual_multiplier);
  return {out, residual, mixed[1]};
}

// Gemma 2's and 3's layer (models/gemma.py GemmaDecoderLayer), its calls in one: x + norm(attention(
// norm(x))), then that + norm(mlp(norm(that))), the MLP gated by gelu_tanh (w.post_norm: the
// post-attention norm); the attention as fused_layer's (q/k norms, window, soft-capping, LoRA).
at::Tensor fused_gemma_layer(const at::Tensor& x, const LayerArgs& w, const StepArgs& step, at::Tensor& k_cache,
                             at::Tensor& v_cache, const std::vector<at::Tensor>& lora,
                             const std::vector<int64_t>& lora_rows) {
  TORCH_CHECK(w.pre_ff_norm.defined() && !w.gate_up.empty() && !w.down.empty() && !w.sinks.has_value(),
              "a Gemma layer's MLP norms and projections, no sinks");
  check_lora(lora, lora_rows);
  const at::Tensor o = attention(normed(x, w.input_norm, w.eps), w, LayerStep{step, k_cache, v_cache}, lora, lora_rows);
  const at::Tensor mid = x.add(normed(o, w.post_norm, w.eps));
  const at::Tensor out =
      mlp(normed(mid, w.pre_ff_norm, w.eps), w.gate_up, w.down, w.gemm, lora, lora_rows, true);
  return mid.add(normed(out, w.post_ff_norm, w.eps));
}

}  // namespace kvserve

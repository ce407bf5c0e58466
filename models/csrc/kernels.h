// Fused CPU kernels for the decoder's small per-layer operations.
//
// Each kernel replaces a chain of eager torch ops (and their dispatch, which
// dominates a batch-1 decode step on a small model) with one pass over the
// data. Every kernel has a plain-torch twin in models/ops/, and the tests
// compare the two. Arithmetic is float32 whatever the storage dtype, rounding
// to the storage dtype exactly where the eager torch code does.
//
// This header declares the kernels the Python module exports (bindings.cpp),
// by the file that holds each; grouped_gemm.h declares the grouped GEMMs.
#pragma once

#include <ATen/core/Tensor.h>

#include "gguf_a8_tiles.h"

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

namespace kvserve {

// rowwise.cpp: RMSNorm (with the residual add), SiLU * up, RoPE + KV-cache write.
void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps);
// x [rows, pieces, n]: each n-value piece rms-normalised in place, as rms_norm a row.
void rms_norm_pieces(at::Tensor& x, const at::Tensor& weight, double eps);
void add_rms_norm(at::Tensor& out, at::Tensor& residual, const at::Tensor& x, const at::Tensor& weight,
                  double eps);
void silu_and_mul(at::Tensor& out, const at::Tensor& gate_up);
void rotary_and_cache(at::Tensor& qkv, const at::Tensor& rotations, const at::Tensor& positions,
                      at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping,
                      int64_t num_heads, int64_t num_kv_heads);

// paged_attention.cpp: decode tokens and prompt chunks, one arithmetic per query token;
// `window` > 0: each query sees only the last `window` positions up to its own; `softcap` > 0:
// each score becomes softcap * tanh(score / softcap) before the softmax (Gemma 2); `sinks`
// (float32, one per query head): a logit each row's softmax counts with no value (gpt-oss).
void paged_decode_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale, int64_t window = 0,
                            double softcap = 0.0, const std::optional<at::Tensor>& sinks = std::nullopt);

void paged_prefill_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& block_tables,
                             const at::Tensor& context_lens, const at::Tensor& query_start, double scale,
                             int64_t window = 0, double softcap = 0.0,
                             const std::optional<at::Tensor>& sinks = std::nullopt);

// dense_gemm.cpp: x @ W^T for unquantised weights packed as [N/16, K, 16], the same
// arithmetic for a row whatever the batch.
void dense_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& w);
// out [M, N] float32 = x [M, K] (float32 rounded to bfloat16, or bfloat16) @ W^T on AMX-BF16
// tiles, W packed by pack_amx_bf16 (dense_gemm_amx.cpp).
void amx_bf16_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& w);
// y = x @ W^T on AMX-BF16 tiles, W as pack_w4a16's 4-bit codes and scales, made
// bfloat16 in the kernel (dense_gemm_amx.cpp).
void amx_w4a16_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales);
// The same for pack_w8a16's 8-bit codes and scales.
void amx_w8a16_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales);
// The weight formats of amx_quant_linear and repack_gguf (models/gguf_linear.py AMX_FORMATS):
// 4-bit codes with d and m per 32 inputs (pack_w4a16), 8-bit codes with d per 32 (pack_w8a16)
// or per 16, and either with an offset m; and the folded formats, whose scales apply to each
// block's tile product (dense_gemm_amx.cpp): 4-bit codes, or codes of up to 7 bits, with D and M
// per 32 or per 16 inputs, or with D alone where M = -1.5 D (codes symmetric about their middle),
// or 4-bit codes with Q4_K's own 6-bit scales and minimums per super-block.
enum AmxWeightFormat : int64_t {
  kAmxW4 = 0,
  kAmxW8 = 1,
  kAmxW8G16 = 2,
  kAmxW8Affine = 3,
  kAmxW8AffineG16 = 4,
  kAmxF4 = 5,
  kAmxF8 = 6,
  kAmxF8G16 = 7,
  kAmxF8G16Sym = 8,
  kAmxF4K = 9
};
// The same for a weight of up to 4 row ranges, each (codes, scales) in its own format
// (AmxWeightFormat: a GGUF tensor's own codes and scales): parts holds codes0, scales0,
// codes1, ... and formats one id per range.
void amx_quant_linear(at::Tensor& out, const at::Tensor& x, const std::vector<at::Tensor>& parts,
                      const std::vector<int64_t>& formats);

// gguf_repack.cpp: a GGUF tensor's blocks (raw [rows, row bytes], ggml type id `type`)
// as amx_quant_linear's `format` for the weight whose row r is raw row source[r] (-1: a
// zero row). False where W4's offsets are not exact (the caller takes another format).
bool repack_gguf(at::Tensor& codes, at::Tensor& scales, const at::Tensor& raw, int64_t type, int64_t format,
                 const at::Tensor& source);

// gguf_a8.cpp: a GGUF file's tensors at their own bits on the int8-activation GEMMs, x's rows
// rounded to int8 per 16 inputs (models/gguf_linear.py A8_FORMATS): Q4_1's and Q5_1's codes
// with the file's float16 d and m per 32 inputs (A4, A5), Q4_K's and Q5_K's codes with their super-blocks' own
// scales, Q6_K's 6-bit codes with a scale per 16 inputs (S16), Q3_K's 3-bit codes with
// the same (K3), and 4-bit indices into
// a table of 16 values (MX4: MXFP4's with its exponent byte per 32; NL4: IQ4_NL's with its float16
// d per 32; NX4: IQ4_XS's with its super-block's d and 6-bit scales), and
// symmetric 4-, 5- and 8-bit codes with the file's float16 scale per 32 (D4: Q4_0; D5: Q5_0;
// D8: Q8_0), and Q2_K's 2-bit codes with their super-block's scale and min per 16 inputs
// (K2). 5-bit codes (K5: Q5_K; D5) are a plane of their low 4 bits and one of their 5th; 3-bit
// codes (K3) two planes of their low 2 bits and one of their 3rd.
enum A8Format : int64_t {
  kA8A4 = 0, kA8A5 = 1, kA8K4 = 2, kA8K5 = 3, kA8S16 = 4, kA8MX4 = 5, kA8NL4 = 6, kA8D4 = 7, kA8D8 = 8, kA8D5 = 9,
  kA8NX4 = 10, kA8K2 = 11, kA8K3 = 12,
  kA8Last = kA8K3  // (the highest: gguf_a8.cpp checks a format against the range)
};
// Bits a code of `format` takes (its codes are [tiles, K/32, bits, 64] bytes).
constexpr int a8_code_bits(int64_t format) {
  return format == kA8D8    ? 8
         : format == kA8S16 ? 6
         : format == kA8K2  ? 2
         : format == kA8K3  ? 3
         : format == kA8K5 || format == kA8D5 || format == kA8A5 ? 5
                                                                  : 4;
}
// Floats in a super-block format's record per 16-row tile and 256 inputs (K4, K5: float16 D, M
// and int8 sc, mn; S16, K3: float16 D and int8 sc per 16 inputs; NX4: float16 D and int8 sc; K2:
// float16 D, M and Q2_K's bytes of sc | mn << 4 per 16 inputs; gguf_a8.cpp's layouts), and
// where its int8 scales start (floats from the record's start).
constexpr int64_t a8_record_floats(int64_t format) {
  return format == kA8S16 || format == kA8K3 ? 72 : format == kA8NX4 ? 40 : 80;
}
constexpr int64_t a8_record_ints(int64_t format) {
  return format == kA8S16 || format == kA8K3 || format == kA8NX4 ? 8 : 16;
}
// Whether `format`'s scales are the file's float16 d (D, NL4) or d and m (A) per row and 32 inputs.
constexpr bool a8_float16_scales(int64_t format) {
  return format == kA8D4 || format == kA8D5 || format == kA8D8 || format == kA8A4 || format == kA8A5 ||
         format == kA8NL4;
}
// out [M, N] = x [M, K] @ W^T for a weight of row ranges, parts = codes0, scales0, codes1, ...
// in their formats; plain: the portable C++ (the tests), which gives the same bits.
void gguf_a8_linear(at::Tensor& out, const at::Tensor& x, const std::vector<at::Tensor>& parts,
                    const std::vector<int64_t>& formats, bool plain);

// gguf_experts.cpp: a layer's experts' weights for one projection, each as gguf_a8_linear's
// parts in any A8Format (expert-major: expert 0's codes0, scales0, codes1, ...;
// every expert of the same formats and shapes), checked when made; bias: each expert's bias,
// float32 [experts, out_features] (gpt-oss), or none. Holds the tensors.
struct A8Experts {
  A8Experts(std::vector<at::Tensor> parts, std::vector<int64_t> formats, int64_t experts, int64_t in_features,
            int64_t out_features, const c10::optional<at::Tensor>& bias);
  std::vector<at::Tensor> parts;
  at::Tensor bias;  // undefined: none
  std::vector<int64_t> formats;
  int64_t experts, in_features, out_features;
  std::vector<A8Segment> first;                 // expert 0's segments (each expert's shapes)
  std::vector<int64_t> columns;                 // each segment's first output column
  std::vector<const uint8_t*> codes_of;         // [expert * segments + segment]
  std::vector<const float*> scales_of;
};
// out [R, N] = each group of x's rows [R, K] (counts[i] rows for expert ids[i], in order)
// against its expert's weight, plus its bias where w has biases (one float add, as torch's
// y + bias); a row's result is its expert's gguf_a8_linear's (and add), bit for bit.
void gguf_a8_experts(at::Tensor& out, const at::Tensor& x, const A8Experts& w, const std::vector<int64_t>& ids,
                     const std::vector<int64_t>& counts, bool plain);
// y [T, H] = each token's k slots' rows of out [S, H] (index [T * k]: slot -> row) scaled by
// weights [T, k] and added in slot order, float32 (torch's products and adds, the same bits).
void mix_expert_rows(at::Tensor& y, const at::Tensor& out, const at::Tensor& index, const at::Tensor& weights);
// y[s] += B_e (A_e x[s]) for each row s of expert[s] = e >= 0: a LoRA adapter's updates of a
// mixture's experts (a [E, r, K], bt [E, r, N] float32), each row's in a fixed order.
void lora_expert_rows(at::Tensor& y, const at::Tensor& x, const at::Tensor& expert, const at::Tensor& a,
                      const at::Tensor& bt);

// A mixture's routers (models/moe_config.py ROUTERS): a softmax over every expert then the k
// largest probabilities, renormalised to sum to 1 or not; or a softmax over the k largest logits.
enum RouterKind : int64_t { kSoftmaxTopK = 0, kSoftmaxTopKNorm = 1, kTopKSoftmax = 2 };
// (weights [T, k] float32, chosen [T, k] int64) of each row of router logits [T, E], the pairs
// in ascending expert id.
std::vector<at::Tensor> route_experts(const at::Tensor& logits, int64_t k, int64_t kind);
// The activation between an expert's gate_up and down projections: silu(gate) * up, gpt-oss's
// clamped SwiGLU, (clamp(up, -limit, limit) + 1) * silu(alpha min(gate, limit)) / alpha, or
// Gemma's gelu_tanh(gate) * up.
enum ExpertActivation : int64_t { kSiluGlu = 0, kClampedSwiGlu = 1, kGeluTanhGlu = 2 };
// (y [T, H], tokens routed to each expert [E]): each row of x through its chosen experts
// (chosen ascending a row; `activation` with limit and alpha between their projections) and
// their outputs mixed by weights, mix_expert_rows's sum. `lora`: LoRA adapters' updates of
// the experts, six tensors an adapter (gate_up's a, bt and which experts it updates, a bool
// [E]; then down's; empty tensors where it leaves a projection alone), added to the products
// of the rows of the tokens lora_owner [T] gives it (its index, -1: none) as
// lora_expert_rows adds them.
std::vector<at::Tensor> moe_experts(const at::Tensor& x, const A8Experts& gate_up, const A8Experts& down,
                                    const at::Tensor& weights, const at::Tensor& chosen, int64_t activation,
                                    double limit, double alpha, const std::vector<at::Tensor>& lora,
                                    const c10::optional<at::Tensor>& lora_owner);

// gguf_a8.cpp: uninitialised codes [tiles, K/32, bits, 64] and scales of `format` for `tiles`
// 16-row tiles and `groups` = K/32 (the shapes a8_segment checks; repack_gguf_a8 fills them).
std::vector<at::Tensor> a8_empty(int64_t format, int64_t tiles, int64_t groups);

// gguf_repack.cpp: a GGUF tensor's blocks as gguf_a8_linear's `format` (A8Format), row r of
// the weight from raw row source[r] (-1: zeros). False where the type's values do not fit
// the format exactly (the caller says so).
bool repack_gguf_a8(at::Tensor& codes, at::Tensor& scales, const at::Tensor& raw, int64_t type, int64_t format,
                    const at::Tensor& source);

// out [len(ids), K] float32: the rows `ids` of raw (a GGUF tensor's blocks of `type`)
// dequantised as models/gguf_quants.py does, bit for bit (an embedding's lookups).
void gguf_rows(at::Tensor& out, const at::Tensor& raw, int64_t type, const at::Tensor& ids);

// argmax.cpp
void argmax_rows(at::Tensor& out, const at::Tensor& x);

// token_bitmask.cpp: a structured output's allowed tokens, the others set to -inf in place.
void apply_token_bitmask(at::Tensor& logits, const at::Tensor& rows, const at::Tensor& masks);

// fused_layer.cpp. The projections' GEMM (models/ops/layer.py GEMM_*).
// kGemmAmxQuant: amx_quant_linear, each projection (codes, scales, ...) with its formats
// as a last int64 tensor; kGemmA8Quant: gguf_a8_linear, the same way.
enum ProjectionGemm : int64_t {
  kGemmGrouped = 0,
  kGemmGroupedInt8 = 1,
  kGemmAmxBf16 = 2,
  kGemmAmxW4a16 = 3,
  kGemmAmxQuant = 4,
  kGemmA8Quant = 5
};
// A decoder layer's arguments that stay the same from step to step (models/ops/layer.py
// FusedWeights), checked once when made: its norms (q_norm, k_norm: per-head or
// whole-projection norms of the queries and keys; pre/post_ff_norm: Gemma's around its MLP),
// each projection in the GEMM `gemm` names, the attention's shape, window, soft-capping and sinks.
struct LayerArgs {
  LayerArgs(at::Tensor input_norm, at::Tensor post_norm, double eps, std::vector<at::Tensor> qkv,
            c10::optional<at::Tensor> qkv_bias, c10::optional<at::Tensor> q_norm, c10::optional<at::Tensor> k_norm,
            std::vector<at::Tensor> o_proj, c10::optional<at::Tensor> o_bias, std::vector<at::Tensor> gate_up,
            std::vector<at::Tensor> down, int64_t num_heads, int64_t num_kv_heads, double scale, int64_t window,
            double softcap, c10::optional<at::Tensor> sinks, int64_t gemm, c10::optional<at::Tensor> pre_ff_norm,
            c10::optional<at::Tensor> post_ff_norm);
  at::Tensor input_norm, post_norm;
  double eps;
  std::vector<at::Tensor> qkv;
  c10::optional<at::Tensor> qkv_bias;
  at::Tensor q_norm, k_norm;  // undefined: none
  std::vector<at::Tensor> o_proj;
  c10::optional<at::Tensor> o_bias;
  std::vector<at::Tensor> gate_up, down;  // empty in a mixture's sparse layer
  int64_t num_heads, num_kv_heads;
  double scale;
  int64_t window;   // a sliding window's positions per query (0: the whole context)
  double softcap;   // scores soft-capped to it (0: none)
  c10::optional<at::Tensor> sinks;  // a sink logit per query head (gpt-oss), float32
  int64_t gemm;
  at::Tensor pre_ff_norm, post_ff_norm;  // undefined: none
};
// A mixture's arguments beyond LayerArgs (models/ops/layer.py FusedExpertsWeights): the router
// (dense_linear's packing, float32 logits, its bias), route_experts' k and kind, the experts'
// projections and activation (moe_experts'), a gated shared expert (Qwen2-MoE) or none, and
// Granite's residual multiplier on both branches (1: none).
struct ExpertsArgs {
  ExpertsArgs(at::Tensor router, c10::optional<at::Tensor> router_bias, std::shared_ptr<A8Experts> gate_up,
              std::shared_ptr<A8Experts> down, int64_t experts_per_token, int64_t router_kind, int64_t activation,
              double limit, double alpha, std::vector<at::Tensor> shared_gate_up, std::vector<at::Tensor> shared_down,
              c10::optional<at::Tensor> shared_gate, double residual_multiplier, int64_t gemm);
  at::Tensor router;
  c10::optional<at::Tensor> router_bias;
  std::shared_ptr<A8Experts> gate_up, down;
  int64_t experts_per_token, router_kind, activation;
  double limit, alpha;
  std::vector<at::Tensor> shared_gate_up, shared_down;
  c10::optional<at::Tensor> shared_gate;
  double residual_multiplier;
};
// What a step's layers share (models/ops/layer.py FusedStep): RoPE's table (real pairs), the
// rows' positions and cache slots, the block tables and context lengths, and the batch's
// shape: num_decodes decodes, then, when prefill_query_start is given, prompt chunks.
struct StepArgs {
  at::Tensor rotations, positions, slot_mapping, block_tables, context_lens;
  int64_t num_decodes;
  c10::optional<at::Tensor> prefill_query_start;
};
// One decoder layer for a step's batch, float32 activations, every projection packed: the same
// kernels the Python layer calls one by one, in one call (no per-op dispatch, and the layer's
// arguments made once). Rows that run a LoRA adapter get its updates (lora: per (start, stop)
// range of lora_rows, (A, B) of the 4 projections). Returns (mlp_out, residual); residual_in
// is None on the first layer, where x is the embedding output and becomes the residual stream.
std::vector<at::Tensor> fused_layer(const at::Tensor& x, const c10::optional<at::Tensor>& residual_in,
                                    const LayerArgs& w, const StepArgs& step, at::Tensor& k_cache,
                                    at::Tensor& v_cache, const std::vector<at::Tensor>& lora,
                                    const std::vector<int64_t>& lora_rows);
// The same layer with a mixture of experts for its MLP (LoRA on the attention's projections
// only). Returns (mlp_out, residual, tokens routed to each expert).
std::vector<at::Tensor> fused_moe_layer(const at::Tensor& x, const c10::optional<at::Tensor>& residual_in,
                                        const LayerArgs& w, const ExpertsArgs& e, const StepArgs& step,
                                        at::Tensor& k_cache, at::Tensor& v_cache, const std::vector<at::Tensor>& lora,
                                        const std::vector<int64_t>& lora_rows,
                                        const std::vector<at::Tensor>& expert_lora,
                                        const c10::optional<at::Tensor>& expert_owner);
// Gemma 2's and 3's decoder layer: x + norm(attention(norm(x))), then that + norm(mlp(norm(that)))
// with a gelu_tanh-gated MLP (models/gemma.py GemmaDecoderLayer's calls, in one). Returns its output.
at::Tensor fused_gemma_layer(const at::Tensor& x, const LayerArgs& w, const StepArgs& step, at::Tensor& k_cache,
                             at::Tensor& v_cache, const std::vector<at::Tensor>& lora,
                             const std::vector<int64_t>& lora_rows);

}  // namespace kvserve

"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, Granite MoE and gpt-oss.

Each is Llama's decoder (``models.llama``: attention, RMSNorm, RoPE, the paged cache)
whose MLP is, in its sparse layers, a ``SparseMoeBlock``:

* a router (``gate``, a linear layer to one logit per expert, read in float32) picks
  each token's experts as its family defines (``MoESettings.router``): a softmax over
  all experts then the k largest probabilities, renormalised to sum to 1 or not
  (Mixtral, Qwen, OLMoE), or the k largest logits then a softmax over them (Granite);
* the step's tokens are grouped by chosen expert, and each expert's gate_up and down
  projections (Llama's ``MLP``, in the same linear kernels as a dense MLP: packed
  float, int4, w4a8, AMX) run over its tokens only, llama.cpp's ``mul_mat_id``
  (``models.experts``: on a GGUF file's codes with ``w4a8``, every chosen expert's rows
  in one call a projection);
* each token's expert outputs, scaled by its router weights, are added in ascending
  expert id from zero, the order of transformers' ``index_add_`` (exact for any k);
* Qwen2-MoE adds a shared expert every token runs, scaled by ``sigmoid(gate(x))``;
* gpt-oss's router and experts carry biases, and its experts gate by a clamped SwiGLU
  (``ClampedSwiGLUExpert``).

Invariance: the kernels' result for a row does not depend on the other rows
(``models.dense``, ``models.quant``), the router's linear is the packed dense GEMM,
and a token's sum runs in an order fixed by its own choice of experts, so a token's
output does not depend on which tokens share its experts or its step
(tests/models/test_moe.py holds it).

What the families change beyond the MLP (``ModelConfig`` and ``MoESettings`` carry it):
Qwen2-MoE's q/k/v biases, Qwen3-MoE's per-head query and key norms, OLMoE's norms over
the whole query and key projections, Granite's multipliers (embedding, attention scale,
each residual branch, a divisor of the logits), Qwen's dense layers (mlp_only_layers,
decoder_sparse_step), gpt-oss's attention sinks (a logit per head in each softmax, in
the paged attention kernels), its output projection's bias and its alternating windowed
layers (``ModelConfig.layer_windows``).

Tensor parallel splits every expert's features across ranks (``models.parallel``). Where
the kernels run it, a sparse layer of SiLU experts on a GGUF file's codes (``w4a8``) runs in
one call (``ops.fused_moe_layer``: attention, router, experts; Mixtral, Qwen3-MoE, OLMoE);
other layers and split ones run op by op, the same bits. LoRA adapters update the
attention's projections, a dense layer's MLP and the routed and shared experts
(``models.lora``, ``models.lora_experts``); not a router (the loader refuses such an adapter,
naming the tensor).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from models import ops
from models.attention import AttentionMetadata
from models.config import ModelConfig
from models.dense import DTYPES, PackedLinear
from models.fused import fused_part_sizes
from models.experts import FusedExperts, mix_experts
from models.llama import (MLP, Attention, FusedSteps, LlamaForCausalLM, RMSNorm, float32_bias, fused_weights,
                          norms_fusable, registrations, same_fused_gemm)
from models.moe_config import MoESettings
from models.lora_experts import SHARED, expert_rows
from models.moe_names import canonical
from models.parallel import TensorParallel, embed
from models.quant import AmxBf16Linear, QuantizedLinear
from models.rope import RotaryEmbedding, interleave_rotary_rows

if TYPE_CHECKING:
    from models.lora import LayerLoRA, LoRABatch
    from models.lora_experts import ExpertRows

_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
_ROUTERS = ("gate", "shared_expert_gate")


def route(logits: torch.Tensor, moe: MoESettings) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits ``[T, E]`` (float32) -> ``(weights [T, k] float32, experts [T, k])``;
    where the kernels run, theirs (``ops.route_experts``: each row's pairs in ascending
    expert id, the arithmetic of the fused MoE layer's router)."""
    if ops.kernels_enabled(logits.device):
        return ops.route_experts(logits, moe.experts_per_token, router_kind(moe))
    if moe.router == "topk-softmax":
        top, experts = logits.topk(moe.experts_per_token, dim=-1)
        return torch.softmax(top, dim=-1), experts
    weights, experts = torch.softmax(logits, dim=-1).topk(moe.experts_per_token, dim=-1)
    if moe.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def router_kind(moe: MoESettings) -> int:
    """``moe``'s router as the kernels name it (``ops.ROUTER_*``)."""
    if moe.router == "topk-softmax":
        return ops.ROUTER_TOPK_SOFTMAX
    return ops.ROUTER_SOFTMAX_TOPK_NORM if moe.norm_topk_prob else ops.ROUTER_SOFTMAX_TOPK


class SparseMoeBlock(nn.Module):
    """Router, experts and (Qwen2-MoE) a gated shared expert; names as in the checkpoints."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None
        self.moe = moe
        self.gate = nn.Linear(config.hidden_size, moe.num_experts, bias=moe.biases)
        expert = replace(config, intermediate_size=moe.expert_size)
        make = (lambda: ClampedSwiGLUExpert(expert, moe)) if moe.swiglu_limit else (lambda: MLP(expert))
        self.experts = nn.ModuleList(make() for _ in range(moe.num_experts))
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_expert_size:
            self.shared_expert = MLP(replace(config, intermediate_size=moe.shared_expert_size))
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        # Tokens routed to each expert since the last take (None: not counted; the metrics' flag).
        self.routed: list[int] | None = None
        # Split across ranks (``parallel.shard_model``): each expert holds this rank's features,
        # and the block's output is all-reduced once.
        self.tp: TensorParallel | None = None
        # The experts held by the kernels as one weight a projection (``fuse_experts``), or None.
        self.fused: FusedExperts | None = None

    def forward(self, x: torch.Tensor, lora: LayerLoRA | None = None) -> torch.Tensor:
        """The block's output; ``lora``: the adapters of the step's rows (their updates of
        the routed and the shared experts; the routers take none)."""
        weights, chosen = route(self.gate(x).float(), self.moe)
        updates = lora.experts(x.shape[0]) if lora is not None else None
        y, counts = mix_experts(self.experts, x, weights, chosen, self.fused, updates)
        if self.routed is not None:
            self.routed = [a + b for a, b in zip(self.routed, counts)]
        if self.shared_expert is not None:
            view = expert_rows(updates, SHARED)
            shared = self.shared_expert(x) if view is None else self.shared_expert(x, view)
            y = y + _sigmoid(self.shared_expert_gate(x)) * shared
        return y if self.tp is None else self.tp.all_reduce(y)


def convert_projection(linear: nn.Linear, quantization: str, packable: bool) -> nn.Module:
    """``linear`` as ``quantization`` runs an expert's projection: the packed dense GEMM
    (``none``, where the kernels run: ``packable``), AMX-BF16 tiles, or int4 groups."""
    if quantization == "none":
        return PackedLinear(linear) if packable else linear
    if quantization in ("amx-bf16", "w4a16"):
        return AmxBf16Linear(linear, quantization)
    return QuantizedLinear(linear, "int4", quantization == "w4a8")


class ClampedSwiGLUExpert(MLP):
    """gpt-oss's expert: projections with biases, and ``(clamp(up, -L, L) + 1) * g *
    sigmoid(alpha * g)`` with ``g = min(gate, L)`` between them (``MoESettings.swiglu_limit``
    L, ``swiglu_alpha``)."""

    def __init__(self, config: ModelConfig, moe: MoESettings) -> None:
        super().__init__(config)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=True)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=True)
        self.limit, self.alpha = moe.swiglu_limit, moe.swiglu_alpha

    # Its forward is down(activate(gate_up(x))), its projections with biases: the fused
    # experts may hold it (models.experts.FusedExperts).
    plain_form = True

    def forward(self, x: torch.Tensor, lora: LayerLoRA | ExpertRows | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if lora is not None:
            gate_up = lora.add("gate_up_proj", x, gate_up)
        h = self.activate(gate_up)
        out = self.down_proj(h)
        return out if lora is None else lora.add("down_proj", h, out)

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The clamped SwiGLU of the gate_up projection's output ``[T, 2I]``."""
        gate, up = gate_up.split(self.intermediate_size, dim=1)
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        # g * sigmoid(a g) = silu(a g) / a, through the row kernel of every SiLU MLP: each
        # value's result depends on it alone, never on its place in the batch (torch's own
        # sigmoid rounds its vector body and scalar tail differently; see _sigmoid).
        # NOTE: ops.moe_experts runs these torch ops in this order (kernel_activation).
        return ops.silu_and_mul(torch.cat([gate * self.alpha, up + 1], dim=1)) / self.alpha

    def kernel_activation(self) -> ops.ExpertActivation:
        """``activate`` as ``ops.moe_experts`` runs it."""
        return ops.ExpertActivation(ops.ExpertActivation.CLAMPED_SWIGLU, self.limit, self.alpha)


def _sigmoid(g: torch.Tensor) -> torch.Tensor:
    """``sigmoid(g)`` for ``g [T, 1]``, each row's value the same in any batch.

    NOTE: torch's vectorised sigmoid and its scalar loop (the tail of a contiguous tensor)
    round differently, so a token's gate would depend on its place in the step; on a
    strided view every element runs the scalar loop.
    """
    strided = g.expand(-1, 2).contiguous()[:, 0]
    return torch.sigmoid(strided).unsqueeze(1)


class MoEAttention(Attention):
    """Llama's attention; with OLMoE's norms over the whole query and key projections, or
    gpt-oss's sinks and output bias."""

    def __init__(self, config: ModelConfig, window: int = 0) -> None:
        super().__init__(config, window)
        if config.moe is not None and config.moe.attention_sinks:
            self.sinks = nn.Parameter(torch.zeros(self.num_heads))
            self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=True)
        if config.moe is not None and config.moe.qk_norm_projection:
            self.q_norm = RMSNorm(self.q_size, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.kv_size, config.rms_norm_eps)
            self.whole_projection_norms = True
        else:
            self.whole_projection_norms = False

    def _norm_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        if not self.whole_projection_norms:
            return super()._norm_heads(qkv)
        q_size, kv_size = self.q_size, self.kv_size
        q = self.q_norm(qkv[:, :q_size].contiguous())
        k = self.k_norm(qkv[:, q_size:q_size + kv_size].contiguous())
        return torch.cat([q, k, qkv[:, q_size + kv_size:]], dim=1)


class MoEDecoderLayer(nn.Module):
    """Llama's layer with an experts block (or, in a dense layer, an MLP) and Granite's
    residual multiplier on both branches."""

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        assert config.moe is not None
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MoEAttention(config, config.layer_window(index))
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SparseMoeBlock(config) if config.moe.is_sparse(index) else MLP(config)
        self.residual_multiplier = config.moe.residual_multiplier

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: RotaryEmbedding,
                positions: torch.Tensor, meta: AttentionMetadata, kv_cache: tuple[torch.Tensor, torch.Tensor],
                lora: LayerLoRA | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp_out, residual)``, as ``models.llama.DecoderLayer``; ``lora`` updates the
        attention's projections, a dense layer's MLP and the routed experts."""
        m = self.residual_multiplier
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, rope, positions, meta, kv_cache, lora)
        h, residual = self.post_attention_layernorm(h * m if m != 1 else h, residual)
        out = self.mlp(h, lora)
        return (out * m if m != 1 else out), residual

    def fused_moe_weights(self) -> tuple[ops.FusedWeights, ops.FusedExpertsWeights] | None:
        """This layer's ``ops.fused_moe_layer`` arguments, or None where that kernel cannot run
        it: it runs a sparse layer of experts held as one weight a projection whose activation
        the kernel runs (``FusedExperts.activation``: SiLU's, gpt-oss's clamped SwiGLU, with
        their biases), whose attention (and shared expert, where it has one) the fused layer
        kernel runs (their projections on one of its GEMMs). Checked once, and again after a
        registration anywhere (``models.llama.registrations``) or a change of the block's
        ``fused`` experts or ``tp`` split."""
        cached, mlp = self.__dict__.get("_fused_moe"), self.mlp
        plain = (mlp.__dict__.get("fused"), mlp.__dict__.get("tp"))  # (attributes no registration counts)
        if cached is not None and cached[2] == registrations() and all(a is b for a, b in zip(cached[3], plain)):
            return None if cached[1] is None else (fused_weights(self, False), cached[1])
        attn, (fused, tp) = self.self_attn, plain
        shared = getattr(mlp, "shared_expert", None)
        shared_parts = () if shared is None else (shared.gate_up_proj, shared.down_proj, mlp.shared_expert_gate)
        key = (attn.qkv_proj, attn.o_proj, mlp, fused, getattr(mlp, "gate", None), tp, shared, *shared_parts)
        if cached is None or len(cached[0]) != len(key) or any(a is not b for a, b in zip(cached[0], key)):
            experts = None
            if fused is not None and self._fused_moe_runs(mlp):
                shared_args = {} if shared is None else dict(
                    shared_gate_up=shared.gate_up_proj.fused_args, shared_down=shared.down_proj.fused_args,
                    shared_gate=mlp.shared_expert_gate.packed)
                experts = ops.FusedExpertsWeights(mlp.gate.packed, router_kind(mlp.moe), mlp.moe.experts_per_token,
                                                  fused.gate_up, fused.down, mlp.gate.bias, fused.activation,
                                                  **shared_args, residual_multiplier=self.residual_multiplier)
        else:
            experts = cached[1]
        self.__dict__["_fused_moe"] = (key, experts, registrations(), plain)  # (a plain attribute, as fused_weights')
        return None if experts is None else (fused_weights(self, False), experts)

    def _fused_moe_runs(self, mlp: SparseMoeBlock) -> bool:
        attn, qkv, o = self.self_attn, self.self_attn.qkv_proj, self.self_attn.o_proj
        router = mlp.gate
        shared = mlp.shared_expert
        # (a shared expert: a plain SiLU MLP on the attention's GEMM, its gate a packed row)
        shared_runs = shared is None or (
            type(shared) is MLP and shared.tp is None and isinstance(mlp.shared_expert_gate, PackedLinear)
            and mlp.shared_expert_gate.bias is None and mlp.shared_expert_gate.packed.dtype == torch.float32
            and same_fused_gemm(qkv, shared.gate_up_proj, shared.down_proj)
            and shared.gate_up_proj.bias is None and shared.down_proj.bias is None)
        return (mlp.fused.activation is not None and shared_runs and mlp.tp is None
                and isinstance(router, PackedLinear) and float32_bias(router)
                and router.packed.dtype == torch.float32
                and same_fused_gemm(qkv, o) and float32_bias(o) and attn.tp is None and norms_fusable(self))

    def forward_fused(self, x: torch.Tensor, residual: torch.Tensor | None, step: ops.FusedStep,
                      kv_cache: tuple[torch.Tensor, torch.Tensor],
                      fused: tuple[ops.FusedWeights, ops.FusedExpertsWeights],
                      lora: LayerLoRA | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` in one kernel call (``ops.fused_moe_layer``) with ``fused``, this layer's
        ``fused_moe_weights()``, for the step ``step`` describes, counting the routed tokens
        where asked; ``lora``: the adapters' updates of the attention and the routed experts
        (``LoRABatch.fusable`` ones)."""
        weights, experts = fused
        expert_lora = lora.experts(x.shape[0]) if lora is not None else None
        out, residual, routed = ops.fused_moe_layer(x, residual, weights, experts, step, kv_cache[0], kv_cache[1],
                                                    lora.fused_args() if lora is not None else None,
                                                    expert_lora.kernel_args() if expert_lora is not None else None)
        if self.mlp.routed is not None:
            self.mlp.routed = [a + b for a, b in zip(self.mlp.routed, routed.tolist())]
        return out, residual


class MoEForCausalLM(LlamaForCausalLM):
    """A mixture-of-experts decoder on Llama's modules (see the module docstring)."""

    def __init__(self, config: ModelConfig) -> None:
        if config.moe is None:
            raise ValueError(f"{config.architecture} needs its experts' settings (ModelConfig.moe)")
        super().__init__(config)
        self.model.layers = nn.ModuleList(MoEDecoderLayer(config, i) for i in range(config.num_hidden_layers))

    def count_routed_tokens(self) -> None:
        """Count the tokens each sparse layer routes to each expert from now on
        (``take_routed_tokens``); off unless asked for (``--expert-routing-metrics``)."""
        for block in self._sparse_blocks().values():
            block.routed = [0] * block.moe.num_experts

    def take_routed_tokens(self) -> dict[int, list[int]]:
        """Each counting sparse layer's tokens per expert since the last take, by layer index."""
        taken = {}
        for i, block in self._sparse_blocks().items():
            if block.routed is not None:
                taken[i], block.routed = block.routed, [0] * block.moe.num_experts
        return taken

    def _sparse_blocks(self) -> dict[int, SparseMoeBlock]:
        return {i: layer.mlp for i, layer in enumerate(self.model.layers) if isinstance(layer.mlp, SparseMoeBlock)}

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                logits_indices: torch.Tensor | None = None, lora: LoRABatch | None = None,
                hidden_indices: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """As ``LlamaForCausalLM.forward``."""
        assert self.rope is not None, "call init_rope() before forward()"
        moe, tp = self.config.moe, self.tp
        x = self.model.embed_tokens(input_ids) if tp is None else embed(self.model.embed_tokens, input_ids, tp)
        if moe.embedding_multiplier != 1:
            x = x * moe.embedding_multiplier
        residual = None
        # Where the kernels run a layer in one call (MoEDecoderLayer.fused_moe_weights), it
        # does: the same bits as op by op (tests/models/test_moe_fused.py), without the per-op
        # dispatch (a fifth of an OLMoE decode step at one stream).
        steps = (FusedSteps(self.rope, positions, meta)
                 if tp is None and (lora is None or lora.fusable) and x.dtype == torch.float32
                 and ops.kernels_enabled(x.device) else None)
        for i, (layer, kv) in enumerate(zip(self.model.layers, kv_caches)):
            fused = layer.fused_moe_weights() if steps is not None else None
            if fused is not None:
                x, residual = layer.forward_fused(x, residual, steps.layer(i), kv, fused,
                                                  lora.layer(i) if lora is not None else None)
                continue
            x, residual = layer(x, residual, self.rope, positions, meta.for_layer(i), kv,
                                lora.layer(i) if lora is not None else None)
        x, hidden = self.final_norm(x, residual, logits_indices, hidden_indices)
        logits = self.lm_head(x)
        if moe.logits_scaling != 1:
            logits = logits / moe.logits_scaling
        logits = logits.float()
        if tp is not None:  # (vocabulary-parallel head: rank 0 gathers every rank's slice)
            logits = tp.gather_rows(logits)
            logits = logits[:, :self.config.vocab_size] if tp.rank == 0 else logits
        return logits if hidden is None else (logits, hidden)

    def prepare_projections(self, quantization: str) -> None:
        """Every projection (attention, each expert, the shared expert) in the form
        ``quantization`` runs it, as ``quant.prepare_projections`` does a dense model's;
        the routers in the packed dense GEMM (their logits decide which experts run)."""
        kernels = ops.kernels_enabled(self.lm_head.weight.device)
        packable = kernels and self.lm_head.weight.dtype in DTYPES
        if quantization == "w4a8" and not ops.has_int8_dots():
            raise ValueError("w4a8 needs kvserve's CPU kernels with vector integer dots (AVX2 or AVX-512); use int4")
        if not packable:  # torch's GEMM runs the dense weights: column-major for it
            self.use_column_major_weights()

        for module in list(self.model.layers.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, nn.Linear) and name in _PROJECTIONS + _ROUTERS:
                    setattr(module, name, convert_projection(child, "none" if name in _ROUTERS else quantization,
                                                             packable))
        head = self.lm_head
        if quantization == "none":
            self.lm_head = PackedLinear(head) if packable else head
        elif quantization in ("amx-bf16", "w4a16"):
            self.lm_head = AmxBf16Linear(head, "w8a16")
        else:
            self.lm_head = QuantizedLinear(head, "int8", quantization == "w4a8")

    def fuse_experts(self) -> None:
        """Each sparse layer's experts as ``FusedExperts`` where they can be: call once their
        projections are final (no later conversion or split of an expert)."""
        for block in self._sparse_blocks().values():
            block.fused = FusedExperts.of(block.experts)

    def pack_routers(self) -> None:
        """The routers (and Qwen2-MoE's shared-expert gates) in the packed dense GEMM, where
        the kernels run: a row's logits, and so its experts, never depend on its batch."""
        device = self.model.norm.weight.device
        for module in list(self.model.layers.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, nn.Linear) and name in _ROUTERS and child.weight.dtype in DTYPES \
                        and ops.kernels_enabled(device):
                    setattr(module, name, PackedLinear(child))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names, any family's layout of its experts) into the
        parameters, checking names and shapes; ``ValueError`` names a stray, misshapen or
        missing tensor."""
        params = dict(self.named_parameters())
        cfg = self.config
        loaded: set[str] = set()
        for ckpt_name, tensor in weights:
            if "rotary_emb.inv_freq" in ckpt_name or (ckpt_name == "lm_head.weight" and cfg.tie_word_embeddings):
                continue
            for name, shard, part in canonical(ckpt_name, tensor, cfg.architecture == "GptOssForCausalLM"):
                param = params.get(name)
                if param is None:
                    raise ValueError(f"checkpoint tensor {ckpt_name!r} does not belong to {cfg.architecture}")
                dst, part = param.data, self._arrange(name, shard, part)
                if shard is not None:
                    sizes = (fused_part_sizes("qkv_proj", cfg) if "qkv_proj" in name else [dst.shape[0] // 2] * 2)
                    dst = dst[sum(sizes[:shard]):sum(sizes[:shard + 1])]
                if tuple(part.shape) != tuple(dst.shape):
                    raise ValueError(f"tensor {ckpt_name!r} has shape {tuple(part.shape)}, expected {tuple(dst.shape)}")
                dst.copy_(part)
                loaded.add(name if shard is None else f"{name}#{shard}")
        expected = set()
        for name in params:
            if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
                expected.update(f"{name}#{i}" for i in range(3))
            elif name.endswith(("gate_up_proj.weight", "gate_up_proj.bias")):
                expected.update(f"{name}#{i}" for i in range(2))
            elif not (name == "lm_head.weight" and cfg.tie_word_embeddings):
                expected.add(name)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {', '.join(missing[:5])}")

    def _arrange(self, name: str, shard: int | None, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor in the parameter's row order: q and k rows (and their norms'
        weights) in the interleaved rotary order of ``rotary_and_cache``."""
        cfg = self.config
        if shard in (0, 1) and "qkv_proj" in name:
            return interleave_rotary_rows(tensor, cfg.num_attention_heads if shard == 0 else cfg.num_key_value_heads)
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            if cfg.moe.qk_norm_projection:  # (OLMoE: one weight per row of the whole projection)
                heads = cfg.num_attention_heads if "q_norm" in name else cfg.num_key_value_heads
                return interleave_rotary_rows(tensor, heads)
            return interleave_rotary_rows(tensor, 1)
        return tensor

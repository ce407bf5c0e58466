"""Gemma 2 and Gemma 3 (text): Llama's attention and projections, with Gemma's differences.

What Gemma changes (``ModelConfig`` carries each, from its config.json or GGUF):

* norms scale by ``1 + w``: the loader adds ``norm_offset`` to every norm weight once
  (a GGUF's converter already did), so the norm kernels stay Llama's;
* four norms a layer: before and after the attention, before and after the MLP, whose
  outputs (post-norms) are added to the residual stream;
* the MLP gates with GELU (tanh approximation) instead of SiLU;
* the embedding is multiplied by sqrt(hidden_size) (in the activations' dtype);
* the attention scaled by ``query_pre_attn_scalar ** -0.5``;
* sliding-window layers (``layer_windows``): Gemma 2's every other layer, Gemma 3's five
  of six, these with a RoPE base of their own (``local_rope_theta``);
* Gemma 3: per-head query and key norms (Qwen3's);
* Gemma 2: soft-capping, ``cap * tanh(x / cap)``, of the attention scores before the
  softmax (``attn_logit_softcap``, in the paged-attention kernels) and of the logits
  (``final_logit_softcap``), so the sampler and logprobs see capped logits, as
  transformers returns them.

Where every projection runs one of the fused layer's GEMMs, each layer is one kernel call
(``ops.fused_gemma_layer``: the four norms, the attention with its window, soft-capping and
q/k norms, the gelu_tanh MLP, LoRA rows too), the same bits as op by op; otherwise op by op,
with the same GEMMs and paged-attention kernels. Not yet with tensor parallel. Gemma 4
(models/gemma4.py) builds on these classes, op by op.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from models.attention import AttentionMetadata
from models.config import ModelConfig
from models import ops
from models.llama import (MLP, Attention, FusedSteps, LlamaForCausalLM, RMSNorm, float32_bias, fused_weights,
                          norms_fusable, same_fused_gemm)
from models.rope import RotaryEmbedding

if TYPE_CHECKING:
    from models.lora import LayerLoRA, LoRABatch


class GemmaMLP(MLP):
    """down(gelu_tanh(gate(x)) * up(x)), gate and up in one projection: Llama's MLP with
    another activation."""

    @staticmethod
    def activate(gate_up: torch.Tensor) -> torch.Tensor:
        """``gelu_tanh(gate) * up`` of the gate_up projection's output."""
        # NOTE: ops.moe_experts runs these torch ops on the same views (kernel_activation).
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def kernel_activation(self) -> ops.ExpertActivation:
        """``activate`` as ``ops.moe_experts`` runs it (Gemma 4's experts)."""
        return ops.ExpertActivation(ops.ExpertActivation.GELU_TANH_GLU)


class GemmaDecoderLayer(nn.Module):
    """Norm, attention, norm, add; norm, MLP, norm, add."""

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps)
        self.self_attn = Attention(config, config.layer_window(index))
        self.post_attention_layernorm = RMSNorm(size, eps)
        self.pre_feedforward_layernorm = RMSNorm(size, eps)
        self.mlp = GemmaMLP(config)
        self.post_feedforward_layernorm = RMSNorm(size, eps)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, torch.Tensor], lora: LayerLoRA | None = None) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), rope, positions, meta, kv_cache, lora)
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x), lora))

    def fusable(self) -> bool:
        """Whether ``ops.fused_gemma_layer`` runs this layer: its four projections on one of the
        fused layer's GEMMs (one kind), no MLP biases, one eps for its norms. Checked once, and
        again when a projection is replaced (the whole check took 14 us a layer, every step)."""
        attn, mlp = self.self_attn, self.mlp
        projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        cached = self.__dict__.get("_fusable")
        if cached is not None and all(a is b for a, b in zip(cached[0], projections)):
            return cached[1]
        norms = (self.input_layernorm, self.post_attention_layernorm, self.pre_feedforward_layernorm,
                 self.post_feedforward_layernorm)
        runs = (type(self) is GemmaDecoderLayer and type(mlp) is GemmaMLP and attn.sinks is None and attn.tp is None
                and same_fused_gemm(*projections) and float32_bias(attn.o_proj)
                and all(p.bias is None for p in projections[2:])
                and len({n.eps for n in norms}) == 1 and norms_fusable(self))
        self.__dict__["_fusable"] = (projections, runs)  # (a plain attribute, as fused_weights')
        return runs

    def forward_fused(self, x: torch.Tensor, step: ops.FusedStep, kv_cache: tuple[torch.Tensor, torch.Tensor],
                      lora: LayerLoRA | None = None) -> torch.Tensor:
        """``forward`` in one kernel call (``fusable``) for the step ``step`` describes."""
        weights = fused_weights(self, True)
        return ops.fused_gemma_layer(x, weights, step, kv_cache[0], kv_cache[1],
                                     lora.fused_args() if lora is not None else None)


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2's and 3's decoder on Llama's modules and loader (``load_weights``)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.model.layers = nn.ModuleList(GemmaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.local_rope: RotaryEmbedding | None = None

    def init_rope(self, max_positions: int) -> None:
        """The full-attention layers' table and the windowed layers' (their own base, unscaled;
        Gemma 2's share the full layers')."""
        super().init_rope(max_positions)
        if self.config.local_rope_theta is None:
            self.local_rope = self.rope
            return
        local = replace(self.config, rope_theta=self.config.local_rope_theta,
                        rope_scaling=None, rope_freq_factors=None)
        self.local_rope = RotaryEmbedding(local, max_positions, self.model.norm.weight.device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                logits_indices: torch.Tensor | None = None, lora: LoRABatch | None = None,
                hidden_indices: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """As ``LlamaForCausalLM.forward`` (no tensor parallel)."""
        assert self.rope is not None and self.local_rope is not None, "call init_rope() before forward()"
        if self.tp is not None:
            raise ValueError("Gemma runs without tensor parallel here")
        x = self.model.embed_tokens(input_ids)
        # sqrt(hidden_size) made float32, then the activations' dtype, as transformers' Gemma does
        x = x * torch.tensor(self.config.hidden_size ** 0.5).to(x.dtype)
        # Each layer in one kernel call where the kernels run them all: the same bits
        # (tests/models/test_gemma_fused.py), none of the per-op dispatch.
        fused = ((lora is None or lora.fusable) and x.dtype == torch.float32 and ops.kernels_enabled(x.device)
                 and all(layer.fusable() for layer in self.model.layers))
        steps = {id(r): FusedSteps(r, positions, meta) for r in (self.rope, self.local_rope)} if fused else {}
        for i, (layer, kv) in enumerate(zip(self.model.layers, kv_caches)):
            rope = self.local_rope if layer.self_attn.window else self.rope
            layer_lora = lora.layer(i) if lora is not None else None
            if fused:
                x = layer.forward_fused(x, steps[id(rope)].layer(i), kv, layer_lora)
            else:
                x = layer(x, rope, positions, meta.for_layer(i), kv, layer_lora)
        return self.head(x, logits_indices, hidden_indices)

    def head(self, x: torch.Tensor, logits_indices: torch.Tensor | None,
             hidden_indices: torch.Tensor | None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The last layer's output ``x`` to ``forward``'s result: the final norm, the LM head
        on the ``logits_indices`` rows, soft-capped (``final_logit_softcap``), in float32."""
        hidden = None
        if hidden_indices is not None:
            hidden = self.model.norm(x.index_select(0, hidden_indices)).float()
        if logits_indices is not None:
            x = x.index_select(0, logits_indices)
        logits = self.lm_head(self.model.norm(x)).float()
        cap = self.config.final_logit_softcap
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits if hidden is None else (logits, hidden)

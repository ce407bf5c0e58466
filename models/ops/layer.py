"""A whole decoder layer in one kernel call (``csrc/fused_layer.cpp``): its arguments
that stay the same from step to step (``FusedWeights``; a mixture's router and experts:
``FusedExpertsWeights``), those a step's layers share (``FusedStep``), and the GEMM each
projection runs on (``GEMM_*``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from models.ops.build import load_extension
from models.ops.linear import SILU_GLU, ExpertActivation


# The fused layer's GEMM for a layer's projections (csrc/kernels.h ProjectionGemm): the
# grouped kernel with float or int8 activations, AMX-BF16 on bfloat16 weights, or
# AMX-BF16 on 4-bit weights made bfloat16 in the kernel, or on a GGUF file's own codes
# (amx_quant_linear: row ranges in their formats).
GEMM_GROUPED, GEMM_GROUPED_INT8, GEMM_AMX_BF16, GEMM_AMX_W4A16, GEMM_AMX_QUANT, GEMM_A8_QUANT = 0, 1, 2, 3, 4, 5


@dataclass(frozen=True, slots=True)
class FusedWeights:
    """A decoder layer's arguments to ``fused_layer`` that stay the same from step to step:
    its norms, and each projection as its ``(codes, scales)`` multiplied by the GEMM
    ``gemm`` names (``GEMM_*``, one for all four: the projection's ``fused_gemm``)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    qkv: list[torch.Tensor]
    qkv_bias: torch.Tensor | None
    o_proj: list[torch.Tensor]
    gate_up: list[torch.Tensor]
    down: list[torch.Tensor]
    num_heads: int
    num_kv_heads: int
    scale: float
    gemm: int
    # RMSNorm weights of the query and key heads before RoPE: ``head_dim`` values (each head:
    # Qwen3) or the whole projection's (OLMoE); None: no such norms.
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    # The output projection's bias; the attention's sliding window (0: none), soft-capping of
    # its scores (0: none) and sink logits, float32 a query head (gpt-oss), as the paged
    # attention kernels take them.
    o_bias: torch.Tensor | None = None
    window: int = 0
    softcap: float = 0.0
    sinks: torch.Tensor | None = None
    # Gemma's norms before and after its MLP (``fused_gemma_layer``); None in other layers.
    pre_ff_norm: torch.Tensor | None = None
    post_ff_norm: torch.Tensor | None = None
    # The kernels' own object of these arguments, made on first use (``args``).
    _args: object = field(default=None, init=False, repr=False, compare=False)

    def args(self, ext: object) -> object:
        """These arguments as the kernels' ``LayerArgs``, made (and checked) once: passing
        some 40 arguments to each layer's call took about 45 us of pybind11's conversions."""
        if self._args is None:
            object.__setattr__(self, "_args", ext.LayerArgs(
                self.input_norm, self.post_norm, self.eps, self.qkv, self.qkv_bias, self.q_norm, self.k_norm,
                self.o_proj, self.o_bias, self.gate_up, self.down, self.num_heads, self.num_kv_heads, self.scale,
                self.window, self.softcap, self.sinks, self.gemm, self.pre_ff_norm, self.post_ff_norm))
        return self._args


# The routers of ``route_experts`` and ``fused_moe_layer`` (csrc/kernels.h RouterKind): a
# softmax over every expert then the k largest probabilities (renormalised: ``_NORM``), or a
# softmax over the k largest logits.
ROUTER_SOFTMAX_TOPK, ROUTER_SOFTMAX_TOPK_NORM, ROUTER_TOPK_SOFTMAX = 0, 1, 2


@dataclass(frozen=True, slots=True)
class FusedExpertsWeights:
    """A mixture-of-experts layer's arguments to ``fused_moe_layer`` beyond ``FusedWeights``'
    attention half: the router (``dense_linear``'s packing, float32; its float32 bias or
    None), its kind (``ROUTER_*``) and experts a token, and the experts' projections (each
    ``ops.a8_experts``, with their biases) and activation; a gated shared expert's
    projections (``fused_args``, on the attention's GEMM) and its gate (``dense_linear``'s
    packing of one output), or none (Qwen2-MoE has one)."""

    router: torch.Tensor
    router_kind: int
    experts_per_token: int
    gate_up: object
    down: object
    router_bias: torch.Tensor | None = None
    activation: ExpertActivation = SILU_GLU
    shared_gate_up: Sequence[torch.Tensor] = ()
    shared_down: Sequence[torch.Tensor] = ()
    shared_gate: torch.Tensor | None = None
    # Granite's: the attention's and the MLP's outputs scaled by it (1: not)
    residual_multiplier: float = 1.0
    _args: object = field(default=None, init=False, repr=False, compare=False)

    def args(self, ext: object, gemm: int) -> object:
        """These arguments as the kernels' ``ExpertsArgs`` (the shared expert's projections on
        the GEMM ``gemm``), made once, as ``FusedWeights.args``."""
        if self._args is None:
            a = self.activation
            object.__setattr__(self, "_args", ext.ExpertsArgs(
                self.router, self.router_bias, self.gate_up, self.down, self.experts_per_token, self.router_kind,
                a.kind, a.limit, a.alpha, list(self.shared_gate_up), list(self.shared_down), self.shared_gate,
                self.residual_multiplier, gemm))
        return self._args


@dataclass(frozen=True, slots=True)
class FusedStep:
    """What every layer's ``fused_layer`` call in one step shares, prepared once a step.

    The step is ``num_decodes`` decodes (one token per sequence) and then, when
    ``prefill_query_start`` is given, prompt chunks: the remaining sequences'
    tokens, at those offsets (int64, from 0 to their token count) after the
    decode rows. ``rotations``: the RoPE table (complex, as ``RotaryEmbedding`` keeps it).
    """

    rotations: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    num_decodes: int
    prefill_query_start: torch.Tensor | None = None
    _args: object = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # The kernel reads the table as real pairs and the tables as dense rows.
        object.__setattr__(self, "rotations", torch.view_as_real(self.rotations))
        object.__setattr__(self, "block_tables", self.block_tables.contiguous())
        object.__setattr__(self, "context_lens", self.context_lens.contiguous())

    def args(self, ext: object) -> object:
        """This step as the kernels' ``StepArgs``, made once for all its layers."""
        if self._args is None:
            object.__setattr__(self, "_args", ext.StepArgs(
                self.rotations, self.positions, self.slot_mapping, self.block_tables, self.context_lens,
                self.num_decodes, self.prefill_query_start))
        return self._args


def fused_layer(x: torch.Tensor, residual: torch.Tensor | None, weights: FusedWeights, step: FusedStep,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                lora: tuple[list[torch.Tensor], list[int]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole decoder layer for a step in one kernel call; ``(mlp_out, residual)``.

    Float32 activations on CPU. ``lora``: LoRA updates for row ranges
    (``models.lora.LoRABatch.fused_args``). The same arithmetic as the layer's op-by-op path.
    """
    ext = load_extension()
    assert ext is not None, "fused_layer needs the fused CPU kernels"
    out, res = ext.fused_layer(x, residual, weights.args(ext), step.args(ext), k_cache, v_cache, *(lora or ([], [])))
    return out, res


def fused_gemma_layer(x: torch.Tensor, weights: FusedWeights, step: FusedStep, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, lora: tuple[list[torch.Tensor], list[int]] | None = None
                      ) -> torch.Tensor:
    """A whole Gemma 2 or 3 decoder layer for a step in one kernel call: ``x + norm(attention(
    norm(x)))``, then that ``+ norm(mlp(norm(that)))`` with Gemma's gelu_tanh-gated MLP
    (``weights.post_norm`` the post-attention norm, ``pre_ff_norm`` and ``post_ff_norm`` the
    MLP's). Float32 activations on CPU; ``lora`` as ``fused_layer``'s. The same arithmetic as
    ``models.gemma.GemmaDecoderLayer``."""
    ext = load_extension()
    assert ext is not None, "fused_gemma_layer needs the fused CPU kernels"
    return ext.fused_gemma_layer(x, weights.args(ext), step.args(ext), k_cache, v_cache, *(lora or ([], [])))


def fused_moe_layer(x: torch.Tensor, residual: torch.Tensor | None, weights: FusedWeights,
                    experts: FusedExpertsWeights, step: FusedStep, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, lora: tuple[list[torch.Tensor], list[int]] | None = None,
                    experts_lora: tuple[list[torch.Tensor], torch.Tensor] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A whole mixture-of-experts decoder layer for a step in one kernel call: ``fused_layer``'s
    attention half (``weights``; its ``gate_up`` and ``down`` unused), then the router,
    ``route_experts`` and ``moe_experts``. ``(mlp_out, residual, tokens routed to each
    expert)``; float32 activations on CPU; ``lora``: as ``fused_layer``'s, updates of the
    attention's projections; ``experts_lora``: the routed experts' (``moe_experts``'
    ``lora``). The same arithmetic as the op-by-op layer (``models.moe``)."""
    ext = load_extension()
    assert ext is not None, "fused_moe_layer needs the fused CPU kernels"
    return tuple(ext.fused_moe_layer(x, residual, weights.args(ext), experts.args(ext, weights.gemm), step.args(ext),
                                     k_cache, v_cache, *(lora or ([], [])), *(experts_lora or ([], None))))

"""A mixture of experts' checkpoint tensors under the names ``models.moe`` loads
(``canonical``): Mixtral's w1 / w3 / w2, Granite's and transformers 5's stacked experts,
gpt-oss's transposed and interleaved ones."""

from __future__ import annotations

import re

import torch

from models.fused import FUSED_PARTS


# Mixtral's expert projections, as its checkpoints name them.
_MIXTRAL_EXPERTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_MIXTRAL_EXPERT = re.compile(r"(.*\.experts\.\d+)\.(w[123])\.weight$")
# Experts stacked in one tensor [E, ...]: Granite's checkpoints, and transformers 5's own layout.
_STACKED = {".mlp.input_linear.weight": "gate_up_proj", ".mlp.output_linear.weight": "down_proj",
            ".mlp.experts.gate_up_proj": "gate_up_proj", ".mlp.experts.down_proj": "down_proj"}


def _gpt_oss_experts(name: str, tensor: torch.Tensor) -> list[tuple[str, int | None, torch.Tensor]] | None:
    """gpt-oss's stacked experts, stored for ``x @ W`` ([E, H, 2I] with gate and up
    interleaved, [E, I, H]) with their biases, as per-expert rows; None for another tensor."""
    prefix, _, kind = name.rpartition(".mlp.experts.")
    if not prefix:
        return None
    experts = f"{prefix}.mlp.experts"
    if kind == "gate_up_proj":
        return [(f"{experts}.{e}.gate_up_proj.weight", i, t.T[i::2]) for e, t in enumerate(tensor) for i in (0, 1)]
    if kind == "gate_up_proj_bias":
        return [(f"{experts}.{e}.gate_up_proj.bias", i, t[i::2]) for e, t in enumerate(tensor) for i in (0, 1)]
    if kind == "down_proj":
        return [(f"{experts}.{e}.down_proj.weight", None, t.T) for e, t in enumerate(tensor)]
    if kind == "down_proj_bias":
        return [(f"{experts}.{e}.down_proj.bias", None, t) for e, t in enumerate(tensor)]
    return None


def canonical(name: str, tensor: torch.Tensor, gpt_oss: bool = False) -> list[tuple[str, int | None, torch.Tensor]]:
    """A checkpoint tensor as ``(parameter, part, tensor)`` triples: ``part`` is its place
    in a fused projection (q, k, v of ``qkv_proj``; gate, up of ``gate_up_proj``) or None.
    Mixtral and Granite keep their experts under ``block_sparse_moe``; Mixtral names their
    projections w1, w3, w2; Granite stacks them ([E, 2I, H] gate then up, [E, H, I]);
    gpt-oss names its router ``router`` and stacks its experts transposed and interleaved
    (``_gpt_oss_experts``)."""
    name = name.replace(".block_sparse_moe.", ".mlp.").replace(".mlp.router.layer.", ".mlp.gate.")
    if gpt_oss:
        name = name.replace(".mlp.router.", ".mlp.gate.").replace(".self_attn.sinks.weight", ".self_attn.sinks")
        experts = _gpt_oss_experts(name, tensor)
        if experts is not None:
            return experts
    match = _MIXTRAL_EXPERT.match(name)
    if match:
        name = f"{match[1]}.{_MIXTRAL_EXPERTS[match[2]]}.weight"
    for stacked, proj in _STACKED.items():
        if name.endswith(stacked):
            prefix = name[:-len(stacked)]
            if proj == "down_proj":
                return [(f"{prefix}.mlp.experts.{e}.down_proj.weight", None, t) for e, t in enumerate(tensor)]
            return [(f"{prefix}.mlp.experts.{e}.gate_up_proj.weight", i, half)
                    for e, t in enumerate(tensor) for i, half in enumerate(t.chunk(2))]
    for ckpt, (fused, idx) in FUSED_PARTS.items():
        if f".{ckpt}." in name:
            return [(name.replace(f".{ckpt}.", f".{fused}."), idx, tensor)]
    return [(name, None, tensor)]

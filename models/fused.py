"""The decoder's fused projections: which checkpoint projection fills which part.

The decoder (``models.llama``) stores q/k/v as one ``qkv_proj`` and gate/up as
one ``gate_up_proj``; checkpoint loading, LoRA adapters (``models.lora``) and
the path tuner (``models.autotune``) all split or stack along this layout.
"""

from __future__ import annotations

import torch

from models.config import ModelConfig

# Checkpoint projection -> (the decoder's fused projection, place in it).
FUSED_PARTS = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


def fused_part_sizes(fused: str, cfg: ModelConfig) -> list[int]:
    """The output rows of each checkpoint projection a decoder projection holds, in order
    (``qkv_proj``: q, k, v; ``gate_up_proj``: gate, up; ``o_proj``, ``down_proj``: one)."""
    if fused == "qkv_proj":
        q = cfg.num_attention_heads * cfg.head_dim
        kv = cfg.num_key_value_heads * cfg.head_dim
        return [q, kv, kv]
    if fused == "gate_up_proj":
        return [cfg.intermediate_size] * 2
    return [cfg.hidden_size]


def split_fused_checkpoint(name: str, tensor: torch.Tensor, cfg: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """A checkpoint tensor as the projections the loader knows: Phi-3 stores q, k and v
    as one ``qkv_proj`` and gate and up as one ``gate_up_proj`` (in this module's order),
    which become their parts; any other tensor is itself."""
    for fused in ("qkv_proj", "gate_up_proj"):
        if f".{fused}." in name:
            parts = [ckpt for ckpt, (f, _) in FUSED_PARTS.items() if f == fused]
            sizes = fused_part_sizes(fused, cfg)
            if tensor.shape[0] != sum(sizes):
                raise ValueError(f"tensor {name!r} has {tensor.shape[0]} rows, expected {sum(sizes)} "
                                 f"({' + '.join(map(str, sizes))})")
            return [(name.replace(f".{fused}.", f".{ckpt}."), part)
                    for ckpt, part in zip(parts, tensor.split(sizes))]
    return [(name, tensor)]

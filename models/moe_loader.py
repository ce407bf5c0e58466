"""A GGUF mixture of experts' tensors under the names ``models.moe`` loads.

llama.cpp stacks a layer's experts in one tensor per projection, ``blk.N.ffn_gate_exps``,
``ffn_up_exps`` ([n_expert, expert_size, hidden]) and ``ffn_down_exps`` ([n_expert,
hidden, expert_size]), beside the router ``ffn_gate_inp`` ([n_expert, hidden]) and
Qwen2-MoE's shared expert (``ffn_{gate,up,down}_shexp``) and its gate
``ffn_gate_inp_shexp`` (a row of ``hidden``, stored 1-D). Each stacked tensor is
dequantised (``gguf_loader.dequantize``: every type it reads) and split into one HF
tensor per expert; the other tensors take ``gguf_loader.iter_gguf_weights``'s path
(Mixtral's and Granite's Q and K rows un-permuted, as llama.cpp's `llama` permutes them).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from models.config import ModelConfig
from models.gguf_loader import dequantize, iter_gguf_weights
from models.gguf_reader import GGUFFile

# GGUF tensor kind -> the experts' projection each slice fills.
EXPERT_KINDS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# GGUF tensor kind -> the MoE block's module it fills.
BLOCK_KINDS = {"ffn_gate_inp": "gate", "ffn_gate_inp_shexp": "shared_expert_gate",
               "ffn_gate_shexp": "shared_expert.gate_proj", "ffn_up_shexp": "shared_expert.up_proj",
               "ffn_down_shexp": "shared_expert.down_proj"}


def _kind(name: str) -> tuple[str, str] | None:
    """``blk.3.ffn_up_exps.weight`` -> ``("3", "ffn_up_exps")`` for an MoE block's tensor, else None."""
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and (
            parts[2] in EXPERT_KINDS or parts[2] in BLOCK_KINDS):
        return parts[1], parts[2]
    return None


def _torch(w: np.ndarray) -> torch.Tensor:
    # (a mapped F32 tensor is a read-only view of the file; torch wants writable memory)
    return torch.from_numpy(np.array(w, dtype=np.float32, order="C", copy=True))


def iter_gguf_moe_weights(reader: GGUFFile, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, float32 tensor)`` for every tensor of an MoE GGUF file, each stacked
    expert tensor as its experts' tensors (``model.layers.N.mlp.experts.E.gate_proj.weight``)."""
    assert config.moe is not None
    blocks = {t.name for t in reader.tensors if _kind(t.name) is not None}
    yield from iter_gguf_weights(reader, config, skip=blocks)
    for tensor in reader.tensors:
        kind = _kind(tensor.name)
        if kind is None:
            continue
        layer, what = kind
        prefix = f"model.layers.{layer}.mlp"
        w = dequantize(tensor)
        if what in EXPERT_KINDS:
            if w.ndim != 3 or w.shape[0] != config.moe.num_experts:
                raise ValueError(f"tensor {tensor.name!r} has shape {w.shape}, expected "
                                 f"[{config.moe.num_experts} experts, rows, columns]")
            for e in range(w.shape[0]):
                yield f"{prefix}.experts.{e}.{EXPERT_KINDS[what]}.weight", _torch(w[e])
        else:
            if what == "ffn_gate_inp_shexp":
                w = w.reshape(1, -1)  # (one output: llama.cpp's converter squeezes it)
            yield f"{prefix}.{BLOCK_KINDS[what]}.weight", _torch(w)

"""A GGUF mixture of experts' tensors under the names ``models.moe`` loads.

llama.cpp stacks a layer's experts in one tensor per projection, ``blk.N.ffn_gate_exps``,
``ffn_up_exps`` ([n_expert, expert_size, hidden]) and ``ffn_down_exps`` ([n_expert,
hidden, expert_size]), beside the router ``ffn_gate_inp`` ([n_expert, hidden]) and
Qwen2-MoE's shared expert (``ffn_{gate,up,down}_shexp``) and its gate
``ffn_gate_inp_shexp`` (a row of ``hidden``, stored 1-D). Each stacked tensor is
dequantised (``gguf_loader.dequantize``: every type it reads) and split into one HF
tensor per expert; the other tensors take ``gguf_loader.iter_gguf_weights``'s path
(Mixtral's and Granite's Q and K rows un-permuted, as llama.cpp's `llama` permutes them).

``build_native_moe`` is ``gguf_native.build_model`` for these files (``--quantization
w4a16`` on a CPU with AMX-BF16): every projection, each expert's included, a
``NativeLinear`` of the file's own codes at its own type, each expert's rows a slice of
its stacked tensor's blocks; nothing dequantised but the norms, biases and routers.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch import nn

from models.config import ModelConfig
from models.gguf_loader import PERMUTED_ARCHITECTURES, dequantize, iter_gguf_weights
from models.gguf_native import (a8_holds, a8_projection, embedding_from, expert_slice, head_projection, layer_tensors,
                                materialize, projection, rotary_order, splittable)
from models.gguf_reader import GGUFFile, GGUFTensor
from models.moe import MoEForCausalLM, SparseMoeBlock
from models.registry import model_class
from models.repack_cache import RepackCache

# GGUF tensor kind -> the experts' projection each slice fills.
EXPERT_KINDS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# GGUF tensor kind -> the MoE block's module it fills.
BLOCK_KINDS = {"ffn_gate_inp": "gate", "ffn_gate_inp_shexp": "shared_expert_gate",
               "ffn_gate_shexp": "shared_expert.gate_proj", "ffn_up_shexp": "shared_expert.up_proj",
               "ffn_down_shexp": "shared_expert.down_proj"}


def _kind(name: str) -> tuple[str, str, str] | None:
    """``blk.3.ffn_up_exps.weight`` -> ``("3", "ffn_up_exps", "weight")`` for an MoE block's
    tensor (gpt-oss's biases: ``bias``), else None."""
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] in ("weight", "bias") and (
            parts[2] in EXPERT_KINDS or parts[2] in BLOCK_KINDS):
        return parts[1], parts[2], parts[3]
    return None


def _torch(w: np.ndarray) -> torch.Tensor:
    # (a mapped F32 tensor is a read-only view of the file; torch wants writable memory)
    return torch.from_numpy(np.array(w, dtype=np.float32, order="C", copy=True))


def iter_gguf_moe_weights(reader: GGUFFile, config: ModelConfig, skip: set[str] | frozenset[str] = frozenset()
                          ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, float32 tensor)`` for every tensor of an MoE GGUF file but those named
    in ``skip``, each stacked expert tensor as its experts' tensors
    (``model.layers.N.mlp.experts.E.gate_proj.weight``)."""
    assert config.moe is not None
    blocks = {t.name for t in reader.tensors if _kind(t.name) is not None}
    yield from iter_gguf_weights(reader, config, skip=blocks | set(skip))
    for tensor in reader.tensors:
        kind = _kind(tensor.name)
        if kind is None or tensor.name in skip:
            continue
        layer, what, param = kind
        prefix = f"model.layers.{layer}.mlp"
        w = dequantize(tensor)
        if what in EXPERT_KINDS:
            dims = 3 if param == "weight" else 2
            if w.ndim != dims or w.shape[0] != config.moe.num_experts:
                raise ValueError(f"tensor {tensor.name!r} has shape {w.shape}, expected "
                                 f"[{config.moe.num_experts} experts, rows{', columns' if dims == 3 else ''}]")
            for e in range(w.shape[0]):
                yield f"{prefix}.experts.{e}.{EXPERT_KINDS[what]}.{param}", _torch(w[e])
        else:
            if what == "ffn_gate_inp_shexp":
                w = w.reshape(1, -1)  # (one output: llama.cpp's converter squeezes it)
            yield f"{prefix}.{BLOCK_KINDS[what]}.{param}", _torch(w)


# The layer tensors ``build_native_moe`` keeps as codes (the routers are read as floats).
_NATIVE_KINDS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "ffn_gate_exps",
                 "ffn_up_exps", "ffn_down_exps", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")


def native_splittable(reader: GGUFFile) -> bool:
    """Whether every projection of an MoE file, its experts' included, is of a type whose
    codes ``build_native_moe`` keeps (``gguf_quants.SPLIT_TYPES``)."""
    return splittable(reader, _NATIVE_KINDS)


def a8_ready_moe(reader: GGUFFile) -> str | None:
    """``gguf_native.a8_ready`` for an MoE file: why ``w4a8`` cannot keep its projections'
    codes, its experts' included, or None where it can."""
    return a8_holds(layer_tensors(reader, _NATIVE_KINDS))


def build_native_moe(reader: GGUFFile, config: ModelConfig, dtype: torch.dtype, a8: bool = False,
                     cache: RepackCache | None = None) -> MoEForCausalLM:
    """The MoE model of ``config`` on the CPU, every projection a ``NativeLinear`` of the file's codes
    (``a8``: a ``NativeA8Linear``, the int8-activation GEMMs; ``a8_ready_moe`` checks first), from
    ``cache`` where it has them."""
    make = a8_projection if a8 else projection
    cached = cache.projection if cache is not None else lambda name, bias, build: build()
    tensors = {t.name: t for t in reader.tensors}
    permuted = config.architecture in PERMUTED_ARCHITECTURES
    used: set[str] = set()

    def get(i: int, kind: str) -> GGUFTensor:
        name = f"blk.{i}.{kind}.weight"
        if name not in tensors:
            raise ValueError(f"GGUF file has no tensor {name!r}")
        used.add(name)
        return tensors[name]

    def native(module: nn.Module, proj: str, parts: list[GGUFTensor], orders: list | None = None,
               owner: GGUFFile | None = reader) -> None:
        bias = getattr(module, proj).bias is not None
        name = "+".join(t.name for t in parts) + f"#{proj}"  # (an expert's parts: slices named by the expert)
        setattr(module, proj, cached(name, bias, lambda: make(owner, parts, orders or [None] * len(parts), bias)))

    with torch.device("meta"):
        model = model_class(config)(config)
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        q, k, v = get(i, "attn_q"), get(i, "attn_k"), get(i, "attn_v")
        native(attn, "qkv_proj", [q, k, v],
               [rotary_order(int(q.shape[1]), config.num_attention_heads, permuted, config.rotary_dim),
                rotary_order(int(k.shape[1]), config.num_key_value_heads, permuted, config.rotary_dim), None])
        native(attn, "o_proj", [get(i, "attn_output")])
        if not isinstance(mlp, SparseMoeBlock):
            native(mlp, "gate_up_proj", [get(i, "ffn_gate"), get(i, "ffn_up")])
            native(mlp, "down_proj", [get(i, "ffn_down")])
            continue
        gate, up, down = (get(i, f"ffn_{x}_exps") for x in ("gate", "up", "down"))
        for e, expert in enumerate(mlp.experts):
            native(expert, "gate_up_proj", [expert_slice(gate, e), expert_slice(up, e)], owner=None)
            native(expert, "down_proj", [expert_slice(down, e)], owner=None)
        for t in (gate, up, down):
            reader.release(t)
        if mlp.shared_expert is not None:
            native(mlp.shared_expert, "gate_up_proj", [get(i, "ffn_gate_shexp"), get(i, "ffn_up_shexp")])
            native(mlp.shared_expert, "down_proj", [get(i, "ffn_down_shexp")])
    embed = tensors["token_embd.weight"]
    model.lm_head = cached("lm_head", False, lambda: head_projection(reader, tensors.get("output.weight", embed), a8))
    model.model.embed_tokens = embedding_from(embed, dtype)
    materialize(model, dtype)
    # (the head is codes or w8a16 codes; the embedding the file's blocks, or its floats: embedding_from)
    skip = used | {"output.weight", "token_embd.weight"}
    model.load_weights(iter_gguf_moe_weights(reader, config, skip=skip))
    model.pack_routers()
    if a8:
        model.fuse_experts()
    return model

"""Unquantised projections on CPU, in a GEMM whose result for a row does not depend on the batch.

MKL's float32 GEMM and oneDNN's bfloat16 one choose their blocking, and so
the order in which they sum a dot product, from the matrix shape: the same
token gave other logits in a step of 1, 7 or 300 rows (measured on SmolLM2's
shapes, torch 2.13). ``--quantization none`` promises the same result however
a request was batched, so on CPU its projections and LM head run
``ops.dense_linear`` (csrc/dense_gemm.cpp) on weights packed once at load.
"""

from __future__ import annotations

import torch
from torch import nn

from models import ops

TILE = 16  # output rows per packed tile (dense_gemm.cpp's vector width)
DTYPES = (torch.float32, torch.bfloat16)


def pack_dense(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` as ``[ceil(N/16), K, 16]`` (``w[t][k][i] = W[16t + i][k]``), zero-padded rows."""
    n, k = weight.shape
    pad = -n % TILE
    w = weight.detach()
    if pad:
        w = torch.cat([w, w.new_zeros(pad, k)])
    return w.reshape(-1, TILE, k).transpose(1, 2).contiguous()


class PackedLinear(nn.Module):
    """``nn.Linear`` with its weight packed for ``ops.dense_linear`` (float32 or bfloat16)."""

    def __init__(self, dense: nn.Linear) -> None:
        super().__init__()
        if dense.weight.dtype not in DTYPES:
            raise ValueError(f"dense_linear runs float32 or bfloat16 weights, not {dense.weight.dtype}")
        self.in_features, self.out_features = dense.in_features, dense.out_features
        self.bias = dense.bias
        self.register_buffer("packed", pack_dense(dense.weight), persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        """The weight ``[N, K]``, unpacked (a copy: for quantising or inspecting, not for the forward)."""
        return self.packed.transpose(1, 2).reshape(-1, self.in_features)[:self.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ops.dense_linear(x, self.packed, self.out_features)
        return y if self.bias is None else y + self.bias


def pack_model(model: nn.Module) -> nn.Module:
    """Swap the decoder's projections and the LM head for ``PackedLinear``, in place.

    A tied LM head gets its own packed copy; the embedding keeps its rows for lookups.
    """
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj, attn.o_proj = PackedLinear(attn.qkv_proj), PackedLinear(attn.o_proj)
        mlp.gate_up_proj, mlp.down_proj = PackedLinear(mlp.gate_up_proj), PackedLinear(mlp.down_proj)
    model.lm_head = PackedLinear(model.lm_head)
    return model

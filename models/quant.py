"""Weight-only quantisation for fast small-batch decoding on CPU.

At batch 1 a decode step is bound by reading the weights from memory, so
4-bit weights (group size 32, as in GGUF Q4_1) read 8x fewer bytes than
float32. torch's CPU kernels for them (``_weight_int4pack_mm_for_cpu``,
``_weight_int8pack_mm``) are fast only for a few rows with bfloat16
activations; for larger batches a float32 matmul is faster. So each quantised
layer keeps both forms and picks one by the number of rows.

Requantising a GGUF Q4_1 weight keeps its 4-bit codes: Q4_1 stores
``w = d*q + m`` with ``m`` the group minimum and ``d = (max - min) / 15``,
which is what the min/max int4 quantiser below recovers from the dequantised
values. The kernel wants bfloat16 scales, so ``d`` and ``m`` (float16 in the
file) lose three mantissa bits; the tests bound the effect on logits.
"""

from __future__ import annotations

import torch
from torch import nn

GROUP_SIZE = 32
# Up to this many rows the quantised kernel wins: a whole SmolLM2 decode step
# (bench.forward-style, 2-core AVX-512 CPU, column-major float32 weights) took
# 15.7 vs 36.7 ms at 2 rows, 37.4 vs 64.5 at 8, 68 vs 69-87 at 16 and
# 134 vs 125 at 32 (int4 vs float32).
SMALL_BATCH_ROWS = 16


def quantize_int4(weight: torch.Tensor, group_size: int = GROUP_SIZE
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric min/max int4 per group: ``(packed, scales_and_zeros)`` for the CPU kernel.

    The kernel computes ``w = (q - 8) * scale + zero``; with ``q`` in 0..15,
    ``scale = (max - min) / 15`` and ``zero = min + 8 * scale``.
    """
    out_f, in_f = weight.shape
    if in_f % group_size:
        raise ValueError(f"in_features {in_f} is not a multiple of the group size {group_size}")
    w = weight.float().reshape(out_f, in_f // group_size, group_size)
    lo = w.amin(-1, keepdim=True)
    hi = w.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=1e-12)
    q = torch.clamp(torch.round((w - lo) / scale), 0, 15).to(torch.int32).reshape(out_f, in_f)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    zero = lo + 8 * scale
    # [groups, out_features, 2]
    scales_and_zeros = torch.stack([scale.squeeze(-1), zero.squeeze(-1)], dim=-1).transpose(0, 1)
    return packed, scales_and_zeros.contiguous().to(torch.bfloat16)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: ``(int8 weight, bfloat16 scales)``."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = torch.clamp(torch.round(w / scale[:, None]), -127, 127).to(torch.int8)
    return q, scale.to(torch.bfloat16)


class QuantizedLinear(nn.Module):
    """A linear layer with a weight-only quantised copy for small batches.

    ``forward`` uses the quantised kernel for up to ``SMALL_BATCH_ROWS`` rows and
    the dense weight above that. ``kind`` is ``"int4"`` or ``"int8"``.
    """

    def __init__(self, dense: nn.Linear, kind: str) -> None:
        super().__init__()
        if kind not in ("int4", "int8"):
            raise ValueError(f"unknown weight quantisation {kind!r}; use int4 or int8")
        self.kind = kind
        self.in_features, self.out_features = dense.in_features, dense.out_features
        self.weight = dense.weight  # kept (and shared if tied) for large batches
        self.bias = dense.bias
        w = dense.weight.detach()
        if kind == "int4":
            packed, sz = quantize_int4(w)
            self.register_buffer("qweight", packed, persistent=False)
            self.register_buffer("scales", sz, persistent=False)
        else:
            q, s = quantize_int8(w)
            self.register_buffer("qweight", q, persistent=False)
            self.register_buffer("scales", s, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > SMALL_BATCH_ROWS:
            return nn.functional.linear(x, self.weight, self.bias)
        xb = x.to(torch.bfloat16)
        if self.kind == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.qweight, GROUP_SIZE, self.scales)
        else:
            y = torch.ops.aten._weight_int8pack_mm(xb, self.qweight, self.scales)
        y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias


def quantize_model(model: nn.Module, method: str) -> nn.Module:
    """Swap the decoder's projections (int4) and the LM head (int8) for quantised layers, in place.

    ``method`` is ``"int4"`` (the only one for now); CPU only.
    """
    if method != "int4":
        raise ValueError(f"unknown quantization {method!r}; supported: int4")
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = QuantizedLinear(attn.qkv_proj, "int4")
        attn.o_proj = QuantizedLinear(attn.o_proj, "int4")
        mlp.gate_up_proj = QuantizedLinear(mlp.gate_up_proj, "int4")
        mlp.down_proj = QuantizedLinear(mlp.down_proj, "int4")
    # NOTE: the LM head is often tied to the embedding and its rows are many:
    # int8 per channel keeps logits close while reading 4x fewer bytes.
    model.lm_head = QuantizedLinear(model.lm_head, "int8")
    return model

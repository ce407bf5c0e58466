"""Quantised projections for fast decoding on CPU.

A decode step is bound by reading the weights from memory, so 4-bit weights
(group size 32, as in GGUF Q4_1) read 8x fewer bytes than float32. kvserve's
kernels (``ops.grouped_linear``, models/csrc/grouped_gemm.cpp) keep float32
scales and reuse each weight tile for several rows of the batch, with one of
two arithmetics (``quantize_model``'s methods):

* ``int4``: float32 activations, every batch (MKL's float32 GEMM on the
  dense weight is faster for prompt-sized batches, but another summation
  order: a token's logits would depend on how many rows shared its step).
* ``w4a8``: activations rounded to int8 per 16 inputs, integer dot products
  (AVX512-VNNI, else the same sums from AVX-512 BW's or AVX2's byte
  multiply-adds; ``ops.int8_dots``). Faster than both at every batch size, so
  no dense copy.

Requantising a GGUF Q4_1 weight keeps its 4-bit codes: Q4_1 stores
``w = d*q + m`` with ``m`` the group minimum and ``d = (max - min) / 15``,
which is what the min/max quantiser recovers from the dequantised values.
Likewise a Q8_0 weight (``w = d*q``, ``d = max|w| / 127``) keeps its codes in
the int8 LM head. So on the default model ``int4`` computes the file's own
weights, equal to the float path up to summation order.

Without the kernels, torch's ``_weight_int4pack_mm_for_cpu`` and
``_weight_int8pack_mm`` run instead: bfloat16 activations and scales, and
int8 per output channel, so about 0.8 off in the logits.
"""

from __future__ import annotations

import torch
from torch import nn

from models import ops
from models.dense import DTYPES, pack_model

GROUP_SIZE = 32
# Without kvserve's kernels, torch's int4/int8 kernels (bfloat16 activations)
# run up to this many rows and the dense float weight above.
SMALL_BATCH_ROWS = 64


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


def _groups_padded(weight: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``weight [N, K]`` as float32 groups ``[N + pad, K/32, 32]``, rows zero-padded to a multiple of 16."""
    n, k = weight.shape
    if k % GROUP_SIZE:
        raise ValueError(f"in_features {k} must be a multiple of the group size {GROUP_SIZE}")
    w = weight.detach().float().reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    pad = -n % 16
    if pad:
        w = torch.cat([w, w.new_zeros(pad, *w.shape[1:])])
    return w, (n + pad) // 16


def _min_max_4bit(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Q4_1's min/max quantiser over groups of 32: ``(q [N', K/32, 32] uint8, d, m, tiles)``
    with ``w = d * q + m`` (``d, m [N', K/32]``), rows zero-padded to ``N' = 16 tiles``."""
    w, tiles = _groups_padded(weight)
    lo, hi = w.amin(-1), w.amax(-1)
    d = (hi - lo) / 15
    q = torch.where(d[..., None] > 0, torch.round((w - lo[..., None]) / d.clamp(min=1e-30)[..., None]),
                    torch.zeros_like(w)).clamp(0, 15).to(torch.uint8)
    return q, d, lo, tiles


def pack_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``weight [N, K]`` to 4-bit min/max groups of 32 (GGUF Q4_1's scheme) for ``ops.grouped_linear``.

    Returns ``codes [N/16, K/32, 4, 64]`` uint8 and ``scales [N/16, K/32, 2, 16]``
    float32 (``d`` then ``m``, ``w = d * q + m``), rows padded to a multiple of
    16 with zeros; csrc/grouped_gemm.cpp describes the byte order. A Q4_1 weight keeps its codes.
    """
    q, d, lo, tiles = _min_max_4bit(weight)
    groups = q.shape[1]
    # [tiles, 16 rows, groups, half, 4 words, 4 bytes] -> [tiles, groups, words, rows, bytes]:
    # inputs 0..15 in the low nibbles, 16..31 in the high ones.
    q = q.reshape(tiles, 16, groups, 2, 4, 4)
    codes = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4).reshape(tiles, groups, 4, 64)
    scales = torch.stack([d, lo], dim=-1).reshape(tiles, 16, groups, 2).permute(0, 2, 3, 1).contiguous()
    return codes.contiguous(), scales


def pack_amx_bf16(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` as bfloat16 B operands of AMX-BF16's ``tdpbf16ps`` for
    ``ops.amx_bf16_linear``: ``[ceil(N/16), ceil(K/32), 16, 16, 2]``, element
    ``[t, b, p, o, j] = W[16t + o, 32b + 2p + j]``, zero-padded."""
    n, k = weight.shape
    w = torch.nn.functional.pad(weight.detach().to(torch.bfloat16), (0, -k % 32, 0, -n % 16))
    tiles, blocks = w.shape[0] // 16, w.shape[1] // 32
    return w.reshape(tiles, 16, blocks, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


def pack_w4a16(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``weight [N, K]`` to 4-bit min/max groups of 32 (``pack_int4``'s codes: a
    Q4_1 weight keeps its own) laid out for ``ops.amx_w4a16_linear``, which makes them
    bfloat16 B operands of AMX-BF16 tiles in the kernel.

    Returns ``codes [N/16, K/32, 4, 64]`` uint8 and ``scales [N/16, K/32, 2, 16]``
    float32, rows padded to a multiple of 16. Per 16 x 32 block, byte ``r`` of the
    32-bit lane ``L`` of code word ``v`` holds, low nibble, output ``L // 2``'s code
    for input ``2 * (4v + r) + L % 2`` and, high nibble, output ``8 + L // 2``'s for
    the same input: B row ``p = 4v + r`` in two shifts. The scales are ``D = 16 d``
    and ``M = m - 16 d`` per output, so that ``(1 + q/16) * D + M`` (one fused
    multiply-add from a float the kernel makes of the code's bits) is ``d * q + m``
    up to M's rounding.
    """
    return _w4a16_layout(*_min_max_4bit(weight))


def _w4a16_layout(q: torch.Tensor, d: torch.Tensor, lo: torch.Tensor, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``pack_w4a16``'s codes and scales from codes ``q [16 tiles, K/32, 32]`` (0..15) and
    ``d``, ``lo [16 tiles, K/32]`` (``w = d * q + lo``)."""
    groups = q.shape[1]
    q = q.reshape(tiles, 16, groups, 32).permute(0, 2, 1, 3)  # [tiles, groups, output, input]
    lane = torch.arange(16)
    # [v, r, lane] -> the output and input each nibble holds
    inputs = (2 * (4 * torch.arange(4)[:, None, None] + torch.arange(4)[None, :, None]) + lane % 2).expand(4, 4, 16)
    low = q[:, :, (lane // 2).expand(4, 4, 16), inputs]
    high = q[:, :, (8 + lane // 2).expand(4, 4, 16), inputs]
    codes = (low | (high << 4)).permute(0, 1, 2, 4, 3).reshape(tiles, groups, 4, 64)  # [.., v, lane, r]
    big = 16 * d
    scales = torch.stack([big, lo - big], dim=-1).reshape(tiles, 16, groups, 2).permute(0, 2, 3, 1).contiguous()
    return codes.contiguous(), scales


def _symmetric_8bit(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Q8_0's quantiser over groups of 32: ``(q [N', K/32, 32] int8, d [N', K/32], tiles)``
    with ``w = d * q``, ``q`` in -127..127, rows zero-padded to ``N' = 16 tiles``."""
    w, tiles = _groups_padded(weight)
    d = w.abs().amax(-1) / 127
    q = torch.round(w / d.clamp(min=1e-30)[..., None]).clamp(-127, 127).to(torch.int8)
    return q, d, tiles


def pack_w8a16(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``weight [N, K]`` to symmetric 8-bit groups of 32 (``pack_int8``'s codes: a
    Q8_0 weight keeps its own) laid out for ``ops.amx_w8a16_linear``, which makes each
    ``d * q`` a bfloat16 B operand of AMX-BF16 tiles in the kernel.

    Returns ``codes [N/16, K/32, 16, 32]`` int8 and ``scales [N/16, K/32, 16]`` float32
    (``d`` per output), rows padded to a multiple of 16. Row ``p`` of a 16 x 32 block is
    the B row for inputs ``2p, 2p + 1``: byte ``L`` is output ``L // 2``'s code for input
    ``2p + L % 2``, byte ``16 + L`` output ``8 + L // 2``'s, the order in which the
    kernel's conversion writes them.
    """
    q, d, tiles = _symmetric_8bit(weight)
    scales = d.reshape(tiles, 16, q.shape[1]).permute(0, 2, 1).contiguous()
    return _w8a16_codes(q, tiles), scales


def _w8a16_codes(q: torch.Tensor, tiles: int) -> torch.Tensor:
    """``pack_w8a16``'s codes ``[tiles, K/32, 16, 32]`` int8 from ``q [16 tiles, K/32, 32]``."""
    groups = q.shape[1]
    q = q.reshape(tiles, 16, groups, 16, 2).permute(0, 2, 3, 1, 4)  # [tiles, groups, pair p, output, j]
    # [.., p, half, output within the half, j] -> bytes L = 2 * output + j within each half
    return q.reshape(tiles, groups, 16, 2, 8, 2).reshape(tiles, groups, 16, 32).contiguous()


def pack_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``weight [N, K]`` to symmetric 8-bit groups of 32 (GGUF Q8_0's scheme) for ``ops.grouped_linear``.

    ``w = d * q`` with ``q`` in -127..127, stored as unsigned codes ``q + 128``
    with offset ``m = -128 d``, the same form as ``pack_int4``'s: returns
    ``codes [N/16, K/32, 8, 64]`` uint8 and ``scales [N/16, K/32, 2, 16]``
    float32, rows padded to a multiple of 16. A Q8_0 weight keeps its codes.
    """
    q, d, tiles = _symmetric_8bit(weight)
    groups = q.shape[1]
    q = q.to(torch.int16) + 128
    # [tiles, 16 rows, groups, 8 words, 4 bytes] -> [tiles, groups, words, rows, bytes]
    codes = q.to(torch.uint8).reshape(tiles, 16, groups, 8, 4).permute(0, 2, 3, 1, 4).reshape(tiles, groups, 8, 64)
    scales = torch.stack([d, -128 * d], dim=-1).reshape(tiles, 16, groups, 2).permute(0, 2, 3, 1).contiguous()
    return codes.contiguous(), scales


METHODS = ("int4", "w4a8", "amx-bf16", "w4a16")


class QuantizedLinear(nn.Module):
    """A linear layer with a quantised copy of its weight.

    ``kind`` is ``"int4"`` or ``"int8"`` (the weight). With kvserve's kernels
    every batch runs the grouped kernel (float or, with ``int8_activations``,
    int8 activations), whose arithmetic for a row does not depend on the
    other rows, and the dense weight is not kept. Without them, torch's
    quantised kernels run up to ``SMALL_BATCH_ROWS`` rows and the kept dense
    weight above that.
    """

    def __init__(self, dense: nn.Linear, kind: str, int8_activations: bool = False) -> None:
        super().__init__()
        if kind not in ("int4", "int8"):
            raise ValueError(f"unknown weight quantisation {kind!r}; use int4 or int8")
        self.kind = kind
        self.in_features, self.out_features = dense.in_features, dense.out_features
        self.bias = dense.bias
        w = dense.weight.detach()
        # kvserve's own kernels (models/csrc/grouped_gemm.cpp): groups of 32 as in
        # GGUF Q4_1 / Q8_0, float32 scales, the weights reused across the
        # batch. torch's kernels below are the fallback.
        self.fused = ops.kernels_enabled(w.device)
        self.int8_activations = int8_activations and self.fused
        # kept (and shared if tied) for torch's large batches only
        self.weight = None if self.fused else dense.weight
        if self.fused:
            codes, scales = pack_int4(w) if kind == "int4" else pack_int8(w)
            self.register_buffer("codes", codes, persistent=False)
            self.register_buffer("group_scales", scales, persistent=False)
        elif kind == "int4":
            packed, sz = quantize_int4(w)
            self.register_buffer("qweight", packed, persistent=False)
            self.register_buffer("scales", sz, persistent=False)
        else:
            q, s = quantize_int8(w)
            self.register_buffer("qweight", q, persistent=False)
            self.register_buffer("scales", s, persistent=False)

    @property
    def fused_gemm(self) -> int:
        """The fused layer's GEMM for this projection (``ops.fused_layer``)."""
        return ops.GEMM_GROUPED_INT8 if self.int8_activations else ops.GEMM_GROUPED

    @property
    def fused_args(self) -> list[torch.Tensor]:
        """The fused layer's arguments for this projection: its codes and scales."""
        return [self.codes, self.group_scales]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:  # kvserve's grouped kernel, every batch
            y = ops.grouped_linear(x.float(), self.codes, self.group_scales, self.out_features,
                                   self.int8_activations).to(x.dtype)
            return y if self.bias is None else y + self.bias
        if x.shape[0] > SMALL_BATCH_ROWS:
            return nn.functional.linear(x, self.weight, self.bias)
        xb = x.to(torch.bfloat16)
        if self.kind == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.qweight, GROUP_SIZE, self.scales)
        else:
            y = torch.ops.aten._weight_int8pack_mm(xb, self.qweight, self.scales)
        y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias


class AmxBf16Linear(nn.Module):
    """A linear layer multiplied on AMX-BF16 tiles: float32 inputs rounded to bfloat16,
    float32 sums, one arithmetic for every batch size. Where the CPU has AMX-BF16 only
    (``ops.amx_bf16_usable``). ``kind``:

    * ``"amx-bf16"``: the weight kept as bfloat16 B operands (``pack_amx_bf16``,
      ``ops.amx_bf16_linear``).
    * ``"w4a16"``: the weight kept as 4-bit codes (``pack_w4a16``: a Q4_1 weight keeps
      its own), made bfloat16 in the kernel for each call (``ops.amx_w4a16_linear``):
      a quarter of the bytes for a decode step to read, the same tile products.
    * ``"w8a16"``: the weight kept as 8-bit codes (``pack_w8a16``: a Q8_0 weight keeps
      its own), made bfloat16 in the kernel (``ops.amx_w8a16_linear``): the LM head of
      the AMX-BF16 paths.

    ``codes``/``group_scales`` under the grouped kernel's names, as the fused layer
    takes every projection (``ops.fused_layer``)."""

    fused = True
    int8_activations = False

    def __init__(self, dense: nn.Linear, kind: str = "amx-bf16") -> None:
        super().__init__()
        if kind not in ("amx-bf16", "w4a16", "w8a16"):
            raise ValueError(f"unknown AMX-BF16 weight form {kind!r}; use amx-bf16, w4a16 or w8a16")
        if not ops.amx_bf16_usable():
            raise ValueError(f"{kind} needs a CPU with AMX-BF16 (see python -m models.ops); use w4a8")
        self.kind = kind
        self.in_features, self.out_features = dense.in_features, dense.out_features
        self.bias = dense.bias
        if kind == "amx-bf16":
            codes, scales = pack_amx_bf16(dense.weight), torch.empty(0)
        elif kind == "w4a16":
            codes, scales = pack_w4a16(dense.weight)
        else:
            codes, scales = pack_w8a16(dense.weight)
        # The fused layer's GEMM (the LM head, w8a16, runs outside it).
        self.fused_gemm = {"amx-bf16": ops.GEMM_AMX_BF16, "w4a16": ops.GEMM_AMX_W4A16}.get(kind)
        self.register_buffer("codes", codes, persistent=False)
        self.register_buffer("group_scales", scales, persistent=False)

    @property
    def fused_args(self) -> list[torch.Tensor]:
        """The fused layer's arguments for this projection: its codes and scales."""
        return [self.codes, self.group_scales]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "amx-bf16":
            y = ops.amx_bf16_linear(x.float(), self.codes, self.out_features)
        elif self.kind == "w4a16":
            y = ops.amx_w4a16_linear(x.float(), self.codes, self.group_scales, self.out_features)
        else:
            y = ops.amx_w8a16_linear(x.float(), self.codes, self.group_scales, self.out_features)
        y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias


def quantize_model(model: nn.Module, method: str) -> nn.Module:
    """Swap the decoder's projections (int4) and the LM head (int8) for quantised layers, in place.

    ``method`` (CPU only):

    * ``"int4"``: float activations, so the model computes the quantised
      weights exactly (a 4-bit GGUF's own values), every batch in the grouped kernel.
    * ``"w4a8"``: activations rounded to int8 per 16 inputs, integer dot
      products against the centred codes (``ops.int8_dots``); about 2x the int4
      path's GEMM speed, and no dense copies of the projections.
    * ``"amx-bf16"``: the projections' weights as bfloat16 on AMX-BF16 tiles
      (``AmxBf16Linear``), activations rounded to bfloat16 at each; the LM head's int8
      codes made bfloat16 in the kernel (``w8a16``).
    * ``"w4a16"``: as ``amx-bf16``, the weights kept 4-bit (``pack_w4a16``) and made
      bfloat16 in the kernel: the same tile arithmetic, a decode step reading 4-bit codes;
      the same LM head.
    """
    if method not in METHODS:
        raise ValueError(f"unknown quantization {method!r}; supported: {', '.join(METHODS)}")
    if method in ("amx-bf16", "w4a16"):
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_proj, attn.o_proj = AmxBf16Linear(attn.qkv_proj, method), AmxBf16Linear(attn.o_proj, method)
            mlp.gate_up_proj = AmxBf16Linear(mlp.gate_up_proj, method)
            mlp.down_proj = AmxBf16Linear(mlp.down_proj, method)
        # The head reads the most weights a decode step (49,152 rows for SmolLM2): kept as
        # int8 codes (half the bytes of bfloat16) made bfloat16 in the kernel. (w4a8's
        # int8 dots on AMX-INT8 fold every 16 inputs' sums out of the tiles: at 64 rows
        # 15.4 ms against 4.9, at one row 0.8 against 1.2, measured on a 2-core Xeon.)
        model.lm_head = AmxBf16Linear(model.lm_head, "w8a16")
        return model
    int8_acts = method == "w4a8"
    if int8_acts and not ops.has_int8_dots():
        raise ValueError("w4a8 needs kvserve's CPU kernels with vector integer dots (AVX2 or AVX-512); use int4")
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = QuantizedLinear(attn.qkv_proj, "int4", int8_acts)
        attn.o_proj = QuantizedLinear(attn.o_proj, "int4", int8_acts)
        mlp.gate_up_proj = QuantizedLinear(mlp.gate_up_proj, "int4", int8_acts)
        mlp.down_proj = QuantizedLinear(mlp.down_proj, "int4", int8_acts)
    # NOTE: the LM head is often tied to the embedding and its rows are many:
    # int8 keeps logits close while reading 4x fewer bytes.
    model.lm_head = QuantizedLinear(model.lm_head, "int8", int8_acts)
    return model


def prepare_projections(model: nn.Module, quantization: str) -> nn.Module:
    """Put a CPU model's projections in the form its run path multiplies them in, in place.

    ``none``: ``dense.pack_model`` (the batch-invariant dense GEMM) where
    kvserve's kernels run and the dtype is float32 or bfloat16. ``int4`` /
    ``w4a8``: ``quantize_model``. Wherever torch's GEMM still runs on a dense
    weight (no kernels: ``none``, and the large batches of torch's quantised
    path), the weights are made column-major for it first.
    """
    own = getattr(model, "prepare_projections", None)
    if own is not None:  # a family whose layers hold other projections (models/moe.py's experts)
        own(quantization)
        return model
    return prepare_decoder_projections(model, quantization)


def prepare_decoder_projections(model: nn.Module, quantization: str) -> nn.Module:
    """``prepare_projections`` of the decoder's projections (each layer's ``qkv_proj``, ``o_proj``,
    ``gate_up_proj``, ``down_proj``) and the LM head, whatever projections a family adds."""
    kernels = ops.kernels_enabled(model.lm_head.weight.device)
    if quantization == "none":
        if kernels and model.lm_head.weight.dtype in DTYPES:
            return pack_model(model)
        model.use_column_major_weights()
        return model
    if not kernels:  # torch's quantised path keeps the dense weights for large batches
        model.use_column_major_weights()
    return quantize_model(model, quantization)

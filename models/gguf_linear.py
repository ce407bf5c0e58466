"""Projections that keep a GGUF file's own codes and scales, each tensor at its own bits.

A Q4_K_M file stores most projections as Q4_K and some (half the layers' value and
down projections, the LM head) as Q6_K. ``NativeLinear`` holds each of a
projection's parts (``q``, ``k``, ``v`` of a fused ``qkv_proj``) in the AMX-BF16
kernel format that holds its GGUF type exactly (``AMX_FORMATS``): 4-bit codes for
Q4_0, Q4_1 and Q4_K, 8-bit codes with a scale per 32 or 16 inputs (and an offset
where the type has one) for the others; ``ops.amx_quant_linear`` makes each
block bfloat16 in the kernel, as ``w4a16`` does. Nothing is requantised and no
float copy of a projection is made: the codes come from the file's blocks
(``models.gguf_quants``), tensor by tensor.

``QuantizedEmbedding`` looks up token rows from the file's mapped blocks, so the
embedding table (0.9 GB as float32 for a 152k-token vocabulary) is never made.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch
from torch import nn

from models import ops
from models.gguf_quants import Codes, split
from models.quant import _w4a16_layout, _w8a16_codes

# AMX-BF16 weight formats of ``ops.amx_quant_linear`` and ``ops.repack_gguf`` (csrc/kernels.h AmxWeightFormat).
W4, W8, W8_G16, W8_AFFINE, W8_AFFINE_G16 = 0, 1, 2, 3, 4
AMX_FORMATS = {W4: "4-bit, d and m per 32", W8: "8-bit, d per 32", W8_G16: "8-bit, d per 16",
               W8_AFFINE: "8-bit, d and m per 32", W8_AFFINE_G16: "8-bit, d and m per 16"}


def amx_format(codes: Codes) -> int:
    """The AMX format that holds ``codes`` exactly."""
    if codes.bits == 4 and codes.group == 32 and _w4_exact(codes):
        return W4
    if codes.group == 32:
        return W8 if codes.m is None else W8_AFFINE
    return W8_G16 if codes.m is None else W8_AFFINE_G16


def _w4_exact(codes: Codes) -> bool:
    """Whether W4's offsets ``M = m - 16 d`` (``quant.pack_w4a16``) are exact in float32, so
    that the kernel's ``(1 + q/16) * 16d + M`` rounds ``d * q + m`` once, as the file's
    dequantisation does. So on every tensor of the Q4_K_M files measured; where not
    (random scales of tests), the tensor takes W8_AFFINE, which holds any 4-bit codes."""
    m = torch.zeros_like(codes.d) if codes.m is None else codes.m
    return bool(((m - 16 * codes.d).double() == m.double() - 16 * codes.d.double()).all())


def _per_16(x: torch.Tensor, group: int) -> torch.Tensor:
    """Per-group values ``[N, K / group]`` as values per 16 inputs ``[N, K / 16]``."""
    return x if group == 16 else x.repeat_interleave(group // 16, dim=1)


def widen(codes: Codes, fmt: int) -> Codes:
    """``codes`` in a form ``fmt`` holds (the same values): 8 bits, per 16 inputs, an offset."""
    if fmt == W4:
        assert amx_format(codes) == W4
        return codes
    group = 16 if fmt in (W8_G16, W8_AFFINE_G16) else 32
    if codes.group < group:
        raise ValueError(f"format {fmt} cannot hold scales per {codes.group} inputs")
    d = _per_16(codes.d, codes.group) if group == 16 else codes.d
    m = codes.m
    if fmt in (W8_AFFINE, W8_AFFINE_G16):
        m = torch.zeros_like(codes.d) if m is None else m
        m = _per_16(m, codes.group) if group == 16 else m
    elif m is not None:
        raise ValueError(f"format {fmt} has no offset for these codes")
    return Codes(codes.q, d, m, group, 8)


def join(fmts: list[int]) -> int:
    """The narrowest format that holds every one of ``fmts``."""
    if all(f == W4 for f in fmts):
        return W4
    g16 = any(f in (W8_G16, W8_AFFINE_G16) for f in fmts)
    affine = any(f in (W4, W8_AFFINE, W8_AFFINE_G16) for f in fmts)
    return (W8_AFFINE_G16 if affine else W8_G16) if g16 else (W8_AFFINE if affine else W8)


def concat(parts: list[Codes]) -> Codes:
    """Parts of one format stacked by rows."""
    first = parts[0]
    m = None if first.m is None else torch.cat([p.m for p in parts])
    return Codes(torch.cat([p.q for p in parts]), torch.cat([p.d for p in parts]), m, first.group, first.bits)


def pack_amx(codes: Codes, fmt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)`` of ``codes`` (rows padded to 16) in AMX format ``fmt``."""
    c = widen(codes, fmt)
    n, k = c.q.shape
    pad = -n % 16
    tiles, groups = (n + pad) // 16, k // 32

    def padded(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x.new_zeros(pad, *x.shape[1:])]) if pad else x

    q = padded(c.q).reshape(n + pad, groups, 32)
    d = padded(c.d)
    if fmt == W4:
        return _w4a16_layout(q.to(torch.uint8), d.reshape(n + pad, groups), padded(c.m).reshape(n + pad, groups),
                             tiles)
    codes_t = _w8a16_codes(q.to(torch.int8), tiles)
    halves = 2 if c.group == 16 else 1
    parts = [d.reshape(tiles, 16, groups, halves)]
    if c.m is not None:
        parts.append(padded(c.m).reshape(tiles, 16, groups, halves))
    # per block: for each half, d[16] then m[16]: [tiles, groups, halves, (d, m), 16]
    scales = torch.stack(parts, dim=-1).permute(0, 2, 3, 4, 1).contiguous()
    return codes_t, scales


# Each GGUF type's format (the one ``amx_format`` gives its codes, before W4's exactness check).
TYPE_FORMATS = {"Q4_0": W4, "Q4_1": W4, "Q4_K": W4, "Q8_0": W8, "Q5_0": W8, "IQ4_NL": W8, "IQ4_XS": W8,
                "Q5_1": W8_AFFINE, "Q5_K": W8_AFFINE, "Q6_K": W8_G16, "Q3_K": W8_G16, "Q2_K": W8_AFFINE_G16}


def plan_segments(formats: list[int], rows: list[int]) -> list[tuple[int, list[int]]]:
    """Parts (their formats and row counts, in order) grouped into segments: ``(format,
    part indices)``. Adjacent parts of one format share a segment, and so do parts whose
    boundary is not on a 16-row tile (in the narrowest format that holds both)."""
    segments: list[tuple[int, list[int]]] = []
    done = 0
    for i, fmt in enumerate(formats):
        if segments and (segments[-1][0] == fmt or done % 16):
            last, members = segments[-1]
            segments[-1] = (join([last, fmt]), [*members, i])
        else:
            segments.append((fmt, [i]))
        done += rows[i]
    return segments


class NativeLinear(nn.Module):
    """A projection whose row ranges (segments: e.g. q and k, then v) keep a GGUF file's
    codes, each in the AMX-BF16 format that holds it (``AMX_FORMATS``), multiplied on
    AMX-BF16 tiles with float32 inputs rounded to bfloat16, one arithmetic for every batch
    size (as ``w4a16``). Build it with ``from_codes`` (``Codes``, the torch reference) or
    from a file's blocks (``models.gguf_native``)."""

    kind = "native"
    fused = True
    int8_activations = False
    fused_gemm = ops.GEMM_AMX_QUANT

    def __init__(self, segments: list[tuple[int, torch.Tensor, torch.Tensor]], in_features: int,
                 out_features: int, bias: bool = False) -> None:
        """``segments``: ``(format, codes, scales)`` in row order, ``out_features`` rows in all."""
        super().__init__()
        if not ops.amx_bf16_usable():
            raise ValueError("a GGUF file's own codes run on AMX-BF16 tiles: this CPU lacks them (see "
                             "python -m models.ops); use --quantization w4a8 or none")
        self.in_features, self.out_features = in_features, out_features
        self.formats = [fmt for fmt, _, _ in segments]
        self._parts = [t for _, codes, scales in segments for t in (codes, scales)]
        for i, t in enumerate(self._parts):
            self.register_buffer(f"part{i}", t, persistent=False)
        self.register_buffer("format_ids", torch.tensor(self.formats, dtype=torch.long), persistent=False)
        self.bias = nn.Parameter(torch.empty(self.out_features), requires_grad=False) if bias else None

    @classmethod
    def from_codes(cls, parts: list[Codes], bias: bool = False) -> NativeLinear:
        """The projection of ``parts`` (row ranges' codes, in order), packed by ``pack_amx``."""
        rows = [p.q.shape[0] for p in parts]
        segments = []
        for fmt, members in plan_segments([amx_format(p) for p in parts], rows):
            segments.append((fmt, *pack_amx(concat([widen(parts[i], fmt) for i in members]), fmt)))
        return cls(segments, parts[0].q.shape[1], sum(rows), bias)

    @property
    def fused_args(self) -> list[torch.Tensor]:
        """The fused layer's arguments for this projection: each segment's codes and
        scales, then the formats."""
        return [*self._parts, self.format_ids]

    def segment_bytes(self) -> list[tuple[int, int]]:
        """Each segment's format and the bytes of codes and scales a pass over it reads."""
        sizes = [t.numel() * t.element_size() for t in self._parts]
        return [(fmt, sizes[2 * i] + sizes[2 * i + 1]) for i, fmt in enumerate(self.formats)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ops.amx_quant_linear(x.float(), self._parts, self.formats, self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias


class QuantizedEmbedding(nn.Module):
    """Token rows of a GGUF tensor's blocks (``data [vocab, row bytes]``, a view of the mapped
    file), split and scaled for the ids looked up: the same float32 values as the whole
    table dequantised, without making it."""

    def __init__(self, type_name: str, data: np.ndarray, shape: tuple[int, int], dtype: torch.dtype) -> None:
        super().__init__()
        self.type_name, self.data, self.shape, self.dtype = type_name, data, shape, dtype
        self.num_embeddings, self.embedding_dim = shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.data[ids.cpu().numpy()]
        return split(self.type_name, rows, (len(rows), self.embedding_dim)).dequantize().to(self.dtype)


def permuted_rows(codes: Codes, permute: Callable[[torch.Tensor], torch.Tensor]) -> Codes:
    """``codes`` with its rows reordered by ``permute`` (a function of a row-major tensor)."""
    return replace(codes, q=permute(codes.q), d=permute(codes.d), m=None if codes.m is None else permute(codes.m))

"""Projections that keep a GGUF file's own codes and scales, each tensor at its own bits.

A Q4_K_M file stores most projections as Q4_K and some (half the layers' value and
down projections, the LM head) as Q6_K. ``NativeLinear`` holds each of a
projection's parts (``q``, ``k``, ``v`` of a fused ``qkv_proj``) in the AMX-BF16
kernel format that holds its GGUF type exactly (``AMX_FORMATS``). By default
(``SCALED_FORMATS``) the kernel makes each block's weights ``d * q + m`` bfloat16
operands (``amx-bf16``'s arithmetic on the dequantised weight): 4-bit codes for Q4_0,
Q4_1 and Q4_K, 8-bit codes with a scale per 32 or 16 inputs (and an offset where the
type has one) for the others. With ``KVSERVE_GGUF_FOLD=1`` (``FOLDED_FORMATS``) types
whose codes have at most 7 bits take a folded format instead: the kernel multiplies
the codes as exact bfloat16 values and applies the scales to each block's product, so
the weights keep every bit (only the inputs are rounded to bfloat16). Nothing is
requantised and no float copy of a projection is made: the codes come from the
file's blocks (``models.gguf_quants``), tensor by tensor.

``QuantizedEmbedding`` looks up token rows from the file's mapped blocks, so the
embedding table (0.9 GB as float32 for a 152k-token vocabulary) is never made.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch
from torch import nn

from models import ops
from models.gguf_quants import Codes, split
from models.gguf_reader import GGMLQuantizationType
from models.quant import _w4a16_layout, _w8a16_codes

# AMX-BF16 weight formats of ``ops.amx_quant_linear`` and ``ops.repack_gguf`` (csrc/kernels.h AmxWeightFormat).
W4, W8, W8_G16, W8_AFFINE, W8_AFFINE_G16, F4, F8, F8_G16, F8_G16S, F4K = range(10)
AMX_FORMATS = {W4: "4-bit, d and m per 32", W8: "8-bit, d per 32", W8_G16: "8-bit, d per 16",
               W8_AFFINE: "8-bit, d and m per 32", W8_AFFINE_G16: "8-bit, d and m per 16", F4: "4-bit, folded per 32",
               F8: "7-bit, folded per 32", F8_G16: "7-bit, folded per 16",
               F8_G16S: "7-bit symmetric, folded per 16", F4K: "4-bit, folded per 32, Q4_K's scales"}
# The folded formats: the kernel multiplies the codes as the exact bfloat16 1 + u/2^bits and
# applies D = 2^bits d and M = m - (offset + 2^bits) d to each 32 (16) inputs' tile product,
# so the weights keep every bit of their scales (dense_gemm_amx.cpp). Each has an 8-bit
# format of the same scales that holds the same codes where its offsets would round.
# F8_G16S (Q6_K, Q3_K: codes u - 2^(bits-1), no m) stores D alone: M = -1.5 D, exactly.
# F4K is F4 with Q4_K's own 6-bit scales and minimums per 256 inputs, from which the kernel
# makes the same D and M (0.09 bytes a weight for the scales, against 0.25): only the
# kernels' repack of a file's blocks makes it (``gguf_native.projection``).
FOLDED = {F4: W8_AFFINE, F8: W8_AFFINE, F8_G16: W8_AFFINE_G16, F8_G16S: W8_G16, F4K: W8_AFFINE}
# The format a tensor falls back to where its own would round an offset (W4: M = m - 16 d).
FALLBACK = {**FOLDED, W4: W8_AFFINE}

# Which arithmetic a GGUF file's codes take. Scaled operands (the default): each block made
# bfloat16 weights d * q + m in the kernel, whose C tiles sum a row's whole dot. Folded
# (KVSERVE_GGUF_FOLD=1): the weights keep every bit and one stream decodes faster (1.5B: 76
# against 89 ms a step at one sequence), but every block's tile is stored and folded, which
# made a 256-token prompt 2x and a 16-sequence step 1.2x the time (bench.peers at 16
# streams: 55.9 against 91.2 output tok/s). Read at load; the path choice keys on it.
FOLD_SWITCH = "KVSERVE_GGUF_FOLD"


def folding() -> bool:
    """Whether GGUF codes load in the folded formats (``FOLD_SWITCH``)."""
    value = os.environ.get(FOLD_SWITCH, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{FOLD_SWITCH}={value!r}: expected 0 or 1")
    return value == "1"


def amx_format(codes: Codes) -> int:
    """The AMX format that holds ``codes`` exactly. Folded (``folding()``): where their codes
    have at most 7 bits and the offsets ``M`` are exact in float32 (every tensor of the real
    files measured). Scaled: 4-bit codes where ``W4``'s offsets are exact. Else 8-bit codes
    with their scales (and offsets)."""
    if not folding():
        # W4 stores F4's offsets M = m - 16 d (quant.pack_w4a16): exact where F4's are
        if codes.bits == 4 and codes.group == 32 and _fold_exact(codes):
            return W4
    elif codes.bits <= 7 and _fold_exact(codes):
        if codes.group == 16:
            return F8_G16S if _symmetric(codes) else F8_G16
        return F4 if codes.bits == 4 else F8
    if codes.group == 32:
        return W8 if codes.m is None else W8_AFFINE
    return W8_G16 if codes.m is None else W8_AFFINE_G16


def _symmetric(codes: Codes) -> bool:
    """Codes ``u - 2^(bits - 1)`` with no offset ``m``: a folded ``M`` of ``-1.5 D``."""
    return codes.m is None and codes.offset == 2 ** (codes.bits - 1)


def _fold_scales(codes: Codes) -> tuple[torch.Tensor, torch.Tensor]:
    """A folded format's ``D = 2^bits d`` and ``M = m - (offset + 2^bits) d`` (float32)."""
    m = torch.zeros_like(codes.d) if codes.m is None else codes.m
    return codes.d * 2.0 ** codes.bits, m - (codes.offset + 2 ** codes.bits) * codes.d


def _fold_exact(codes: Codes) -> bool:
    """Whether the offsets ``M`` of a folded format (and of W4, which stores F4's) are exact in
    float32, so that ``D * (1 + u/2^bits) + M`` is ``d * q + m`` rounded once, as the file's
    dequantisation rounds it. Where not (random scales of tests), the tensor takes the 8-bit
    format of the same scales (``FALLBACK``)."""
    m = torch.zeros_like(codes.d) if codes.m is None else codes.m
    _, big_m = _fold_scales(codes)
    return bool((big_m.double() == m.double() - (codes.offset + 2 ** codes.bits) * codes.d.double()).all())


def _per_16(x: torch.Tensor, group: int) -> torch.Tensor:
    """Per-group values ``[N, K / group]`` as values per 16 inputs ``[N, K / 16]``."""
    return x if group == 16 else x.repeat_interleave(group // 16, dim=1)


def widen(codes: Codes, fmt: int) -> Codes:
    """``codes`` in a form ``fmt`` holds (the same values): 8 bits (F8: 7, each code's span
    made 0..127), per 16 inputs, an offset."""
    if fmt in (F4, W4):
        assert codes.bits == 4 and codes.group == 32
        return codes
    group = 16 if fmt in (W8_G16, W8_AFFINE_G16, F8_G16, F8_G16S) else 32
    if codes.group < group:
        raise ValueError(f"format {fmt} cannot hold scales per {codes.group} inputs")
    d = _per_16(codes.d, codes.group) if group == 16 else codes.d
    m = None if codes.m is None else (_per_16(codes.m, codes.group) if group == 16 else codes.m)
    if fmt in FOLDED:
        if codes.bits > 7:
            raise ValueError(f"format {fmt} holds codes of at most 7 bits")
        # u << (7 - bits) with d / 2^(7 - bits): the same weights, one span for every part
        m = torch.zeros_like(d) if m is None else m
        shift = 7 - codes.bits
        return Codes((codes.q + codes.offset) << shift, d * 2.0 ** -shift, m - codes.offset * d, group, 7)
    if fmt in (W8_AFFINE, W8_AFFINE_G16):
        m = torch.zeros_like(d) if m is None else m
    elif m is not None:
        raise ValueError(f"format {fmt} has no offset for these codes")
    return Codes(codes.q, d, m, group, 8, 128)


def join(fmts: list[int]) -> int:
    """The narrowest format that holds every one of ``fmts``."""
    if len(set(fmts)) == 1:
        return fmts[0]
    fmts = [F4 if f == F4K else f for f in fmts]
    if all(f in FOLDED for f in fmts):
        if len(set(fmts)) == 1:
            return fmts[0]
        return F8_G16 if any(f in (F8_G16, F8_G16S) for f in fmts) else F8
    fmts = [FALLBACK.get(f, f) for f in fmts]
    g16 = any(f in (W8_G16, W8_AFFINE_G16) for f in fmts)
    affine = any(f in (W8_AFFINE, W8_AFFINE_G16) for f in fmts)
    return (W8_AFFINE_G16 if affine else W8_G16) if g16 else (W8_AFFINE if affine else W8)


def concat(parts: list[Codes]) -> Codes:
    """Parts of one format stacked by rows."""
    first = parts[0]
    m = None if first.m is None else torch.cat([p.m for p in parts])
    return Codes(torch.cat([p.q for p in parts]), torch.cat([p.d for p in parts]), m, first.group, first.bits,
                 first.offset)


def pack_amx(codes: Codes, fmt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)`` of ``codes`` (rows padded to 16) in AMX format ``fmt``."""
    if fmt == F4K:
        raise ValueError("format F4K is made from a file's Q4_K blocks (ops.repack_gguf), not from codes")
    c = widen(codes, fmt)
    n, k = c.q.shape
    pad = -n % 16
    tiles, groups = (n + pad) // 16, k // 32

    def padded(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x.new_zeros(pad, *x.shape[1:])]) if pad else x

    halves = 2 if c.group == 16 else 1
    if fmt == W4:
        m = torch.zeros_like(c.d) if c.m is None else c.m
        return _w4a16_layout(padded(c.q).reshape(n + pad, groups, 32).to(torch.uint8),
                             padded(c.d).reshape(n + pad, groups), padded(m).reshape(n + pad, groups), tiles)
    if fmt in FOLDED:
        u = padded(c.q + c.offset)  # padding rows: u = 0 with D = M = 0
        if fmt == F4:
            # chunk p, byte j: B row p's word j (output j / 2, input 2p + j % 2) low, row p + 8's high
            w = u.reshape(tiles, 16, groups, 16, 2).permute(0, 2, 3, 1, 4)  # [t, g, input pair, output, 2]
            w = w.reshape(tiles, groups, 16, 32)
            codes_t = (w[:, :, :8] | (w[:, :, 8:] << 4)).to(torch.uint8).contiguous()
        else:
            codes_t = _w8a16_codes(u.reshape(n + pad, groups, 32).to(torch.int8), tiles).view(torch.uint8)
        scales = _fold_scales(c)[:1] if fmt == F8_G16S else _fold_scales(c)
        parts = [padded(x).reshape(tiles, 16, groups, halves) for x in scales]
    else:
        codes_t = _w8a16_codes(padded(c.q).reshape(n + pad, groups, 32).to(torch.int8), tiles)
        parts = [padded(c.d).reshape(tiles, 16, groups, halves)]
        if c.m is not None:
            parts.append(padded(c.m).reshape(tiles, 16, groups, halves))
    # per block: for each half, d[16] then m[16]: [tiles, groups, halves, (d, m), 16]
    scales = torch.stack(parts, dim=-1).permute(0, 2, 3, 4, 1).contiguous()
    return codes_t, scales


# The formats of ``ops.gguf_a8_linear`` and ``ops.repack_gguf_a8`` (csrc/kernels.h A8Format): a
# GGUF file's codes on the int8-activation GEMMs (``--quantization w4a8`` on a GGUF file), x
# rounded to int8 per 16 inputs and integer dots, each tensor's scales as its type applies
# them (csrc/gguf_a8.cpp). Q4_K keeps 4.625 bits a weight (its scales per super-block), Q5_K
# 5.625, Q6_K 6.5625 (where the AMX formats above take 6 and 10), Q3_K 3.5625 and Q2_K 2.625 (their
# codes in planes of 2 bits, Q3_K's 3rd in one of its own); MXFP4 4.25, IQ4_NL 4.5 and
# IQ4_XS 4.3125 (4-bit indices into their table of 16 values, looked up in the kernel, and the file's
# scales: MXFP4's exponent byte and IQ4_NL's float16 d per 32, IQ4_XS's super-block d and 6-bit
# scales); Q4_0 4.5, Q5_0 5.5 and Q8_0 8.5 (the file's float16 scale per 32), Q4_1 5 and Q5_1 6
# (and its float16 offset).
A8_A4, A8_A5, A8_K4, A8_K5, A8_S16, A8_MX4, A8_NL4, A8_D4, A8_D8, A8_D5, A8_NX4, A8_K2, A8_K3 = range(13)
A8_FORMATS = {A8_A4: "4-bit, float16 d and m per 32", A8_A5: "5-bit, float16 d and m per 32",
              A8_K4: "4-bit, Q4_K's scales",
              A8_K5: "5-bit, Q5_K's scales", A8_S16: "6-bit, a scale per 16",
              A8_MX4: "4-bit MXFP4 table, d per 32", A8_NL4: "4-bit IQ4_NL table, float16 d per 32",
              A8_NX4: "4-bit IQ4_NL table, IQ4_XS's scales",
              A8_D4: "4-bit, float16 d per 32", A8_D8: "8-bit, float16 d per 32", A8_D5: "5-bit, float16 d per 32",
              A8_K2: "2-bit, Q2_K's scales and mins per 16", A8_K3: "3-bit, a scale per 16"}
A8_TYPE_FORMATS = {"Q4_0": A8_D4, "Q4_1": A8_A4, "Q8_0": A8_D8, "Q5_0": A8_D5, "Q5_1": A8_A5,
                   "IQ4_NL": A8_NL4, "IQ4_XS": A8_NX4, "MXFP4": A8_MX4, "Q4_K": A8_K4, "Q5_K": A8_K5,
                   "Q6_K": A8_S16, "Q3_K": A8_K3, "Q2_K": A8_K2}


# Each GGUF type's format, scaled and folded (the one ``amx_format`` gives its codes, before the
# exactness check; F4K only from a file's blocks).
SCALED_FORMATS = {"Q4_0": W4, "Q4_1": W4, "Q4_K": W4, "Q8_0": W8, "Q5_0": W8, "IQ4_NL": W8, "IQ4_XS": W8,
                  "MXFP4": W8, "Q5_1": W8_AFFINE, "Q5_K": W8_AFFINE, "Q6_K": W8_G16, "Q3_K": W8_G16, "Q2_K": W8_AFFINE_G16}
FOLDED_FORMATS = {"Q4_0": F4, "Q4_1": F4, "Q4_K": F4K, "Q8_0": W8, "Q5_0": F8, "IQ4_NL": W8, "IQ4_XS": W8,
                  "MXFP4": W8, "Q5_1": F8, "Q5_K": F8, "Q6_K": F8_G16S, "Q3_K": F8_G16S, "Q2_K": F8_G16}


def type_format(type_name: str) -> int:
    """The format a file's tensor of ``type_name`` loads in (``folding()`` chooses the table)."""
    return (FOLDED_FORMATS if folding() else SCALED_FORMATS)[type_name]


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
    AMX-BF16 tiles with float32 inputs rounded to bfloat16, one arithmetic per segment for
    every batch size. Build it with ``from_codes`` (``Codes``, the torch reference) or
    from a file's blocks (``models.gguf_native``)."""

    kind = "native"
    fused = True
    int8_activations = False
    fused_gemm = ops.GEMM_AMX_QUANT

    def __init__(self, segments: list[tuple[int, torch.Tensor, torch.Tensor]], in_features: int,
                 out_features: int, bias: bool = False) -> None:
        """``segments``: ``(format, codes, scales)`` in row order, ``out_features`` rows in all."""
        super().__init__()
        self._check_cpu()
        self.in_features, self.out_features = in_features, out_features
        self.formats = [fmt for fmt, _, _ in segments]
        self._parts = [t for _, codes, scales in segments for t in (codes, scales)]
        for i, t in enumerate(self._parts):
            self.register_buffer(f"part{i}", t, persistent=False)
        self.register_buffer("format_ids", torch.tensor(self.formats, dtype=torch.long), persistent=False)
        self.bias = nn.Parameter(torch.empty(self.out_features), requires_grad=False) if bias else None

    @staticmethod
    def _check_cpu() -> None:
        if not ops.amx_bf16_usable():
            raise ValueError("a GGUF file's own codes run on AMX-BF16 tiles: this CPU lacks them (see "
                             "python -m models.ops); use --quantization w4a8 or none")

    @classmethod
    def from_codes(cls, parts: list[Codes], bias: bool = False) -> NativeLinear:
        """The projection of ``parts`` (row ranges' codes, in order), packed by ``pack_amx``."""
        rows = [p.q.shape[0] for p in parts]
        segments = []
        for fmt, members in plan_segments([amx_format(p) for p in parts], rows):
            segments.append((fmt, *pack_amx(concat([widen(parts[i], fmt) for i in members]), fmt)))
        return cls(segments, parts[0].q.shape[1], sum(rows), bias)

    @property
    def segments(self) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """``(format, codes, scales)`` of each segment, in row order (what it was made of)."""
        return [(fmt, self._parts[2 * i], self._parts[2 * i + 1]) for i, fmt in enumerate(self.formats)]

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


class NativeA8Linear(NativeLinear):
    """``NativeLinear``'s segments in ``A8_FORMATS`` (``--quantization w4a8`` on a GGUF file):
    the file's codes at their own bits against x rounded to int8 per 16 inputs, integer dots
    on VNNI (or AVX2's multiply-adds, the same sums), one arithmetic for every batch size.
    Built from a file's blocks only (``models.gguf_native.projection``)."""

    kind = "native-a8"
    int8_activations = True
    fused_gemm = ops.GEMM_A8_QUANT

    @staticmethod
    def _check_cpu() -> None:
        if not ops.kernels_available():
            raise ValueError("a GGUF file's own codes with int8 activations need the fused CPU kernels "
                             "(see python -m models.ops)")

    @classmethod
    def from_codes(cls, parts: list[Codes], bias: bool = False) -> NativeLinear:
        raise ValueError("NativeA8Linear is made from a file's blocks (models.gguf_native.projection)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = ops.gguf_a8_linear(x.float(), self._parts, self.formats, self.out_features)
        return (y if self.bias is None else y + self.bias).to(x.dtype)  # (the bias float32, as y)


def file_bytes(data: np.ndarray) -> torch.Tensor:
    """A GGUF tensor's bytes (a read-only view of the mapped file) as a tensor for the kernels,
    which only read it (torch's warning about a non-writable array silenced)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(data)


class QuantizedEmbedding(nn.Module):
    """Token rows of a GGUF tensor's blocks (``data [vocab, row bytes]``, a view of the mapped
    file), split and scaled for the ids looked up: the same float32 values as the whole
    table dequantised, without making it."""

    def __init__(self, type_name: str, data: np.ndarray, shape: tuple[int, int], dtype: torch.dtype) -> None:
        super().__init__()
        self.type_name, self.data, self.shape, self.dtype = type_name, data, shape, dtype
        self.num_embeddings, self.embedding_dim = shape
        self._raw = file_bytes(data.reshape(shape[0], -1))
        self._type_id = int(GGMLQuantizationType[type_name])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # The kernel decodes the rows' blocks in one call (a decode step's lookup took 0.3 ms
        # of torch ops on small tensors); torch's split is the reference it equals.
        rows = ops.gguf_rows(self._raw, self._type_id, ids.cpu(), self.embedding_dim)
        if rows is None:
            picked = self.data[ids.cpu().numpy()]
            rows = split(self.type_name, picked, (len(picked), self.embedding_dim)).dequantize()
        return rows.to(self.dtype)


def permuted_rows(codes: Codes, permute: Callable[[torch.Tensor], torch.Tensor]) -> Codes:
    """``codes`` with its rows reordered by ``permute`` (a function of a row-major tensor)."""
    return replace(codes, q=permute(codes.q), d=permute(codes.d), m=None if codes.m is None else permute(codes.m))

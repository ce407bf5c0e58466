"""A GGUF tensor's own integer codes and scales, read from its blocks without dequantising.

Every quantised GGUF type stores a weight as ``w = d * q + m`` over small groups of
inputs: an integer code ``q`` and, per group, a scale ``d`` and (for some types) an
offset ``m``, each made of the block's half-precision and integer fields. ``split``
returns those parts as tensors (``Codes``), so a kernel format can hold them exactly:
``d * q`` is exact in float32 for every type here (a half-precision value times a
6-bit integer times a code of at most 8 bits), and ``d * q + m`` rounds once, as
``gguf.quants.dequantize`` (llama.cpp's reference) does; the tests hold the two equal
bit for bit.

Types and what they become (group: inputs per ``d``):

=========  ======================  =====  ==============
type       q                       group  m
=========  ======================  =====  ==============
Q4_0       0..15                   32     -8 d
Q4_1       0..15                   32     the block's m
Q4_K       0..15                   32     -dmin * min
Q5_0       -16..15                 32     none
Q5_1       0..31                   32     the block's m
Q5_K       0..31                   32     -dmin * min
Q8_0       -127..127               32     none
Q6_K       -32..31                 16     none
Q3_K       -4..3                   16     none
Q2_K       0..3                    16     -dmin * min
IQ4_NL     the codebook's values   32     none
IQ4_XS     the codebook's values   32     none
MXFP4      twice E2M1's values     32     none
=========  ======================  =====  ==============

(MXFP4, gpt-oss's experts: 4-bit floats with a power-of-two scale per 32, ``d = 2^(e - 128)``
from the block's E8M0 byte ``e``: half the scale, as the codes are twice the values.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

QK_K = 256
# IQ4_NL's and IQ4_XS's 16 code values (llama.cpp's kvalues_iq4nl).
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# MXFP4's E2M1 values times two (llama.cpp's kvalues_mxfp4).
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)

# Block bytes and values per block of each type this module splits.
_BLOCKS = {"Q4_0": (18, 32), "Q4_1": (20, 32), "Q5_0": (22, 32), "Q5_1": (24, 32), "Q8_0": (34, 32),
           "Q2_K": (84, 256), "Q3_K": (110, 256), "Q4_K": (144, 256), "Q5_K": (176, 256), "Q6_K": (210, 256),
           "IQ4_NL": (18, 32), "IQ4_XS": (136, 256), "MXFP4": (17, 32)}
SPLIT_TYPES = tuple(_BLOCKS)
# Each type's span of codes (Codes.bits, Codes.offset).
SPANS = {"Q4_0": (4, 0), "Q4_1": (4, 0), "Q4_K": (4, 0), "Q5_0": (5, 16), "Q5_1": (5, 0), "Q5_K": (5, 0),
         "Q6_K": (6, 32), "Q3_K": (3, 4), "Q2_K": (2, 0), "Q8_0": (8, 128), "IQ4_NL": (8, 128), "IQ4_XS": (8, 128),
         "MXFP4": (8, 128)}
# Where each type's half-precision fields (scales, minimums) sit in its block.
_F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82),
               "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,),
               "MXFP4": ()}


def random_blocks(type_name: str, shape: tuple[int, int], seed: int = 0, scale: float = 0.01,
                  one_scale: bool = False) -> np.ndarray:
    """Random blocks of ``type_name`` for a weight ``shape = (N, K)``: ``[N, row bytes]`` uint8,
    every code and integer scale random, the half-precision fields about ``scale`` (finite,
    so any arithmetic on them runs at its usual speed). For tests and the path choice's probes.

    ``one_scale``: a block's half-precision fields (d and dmin, or d and m) hold one value.
    A real file's scale and minimum are of one size, so the folded offsets ``m - 16 d`` are
    exact in float32 (``gguf_linear.amx_format``) on every real Q4_K tensor measured; with
    independent fields about one group in 10^5 is not, and a 4-bit tensor made of them
    takes 8-bit codes (which the path choice's probes would then time)."""
    block_bytes, per_block = _BLOCKS[type_name]
    n, k = shape
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // per_block, block_bytes), dtype=np.uint8)
    halves = None
    for offset in _F16_FIELDS[type_name]:
        if halves is None or not one_scale:
            halves = (np.abs(rng.standard_normal((n, k // per_block, 1))) * scale + scale / 4).astype(np.float16)
        raw[..., offset:offset + 2] = halves.view(np.uint8)
    if type_name == "MXFP4":  # (its E8M0 exponent: d = 2^(e - 128) about scale / 4 .. scale)
        top = 128 + int(np.floor(np.log2(scale)))
        raw[..., 0] = rng.integers(top - 2, top + 1, size=(n, k // per_block), dtype=np.uint8)
    return raw.reshape(n, -1)


@dataclass(frozen=True)
class Codes:
    """A weight ``[N, K]`` as ``w = d * q + m``: ``q [N, K]`` (int16), ``d [N, K / group]``
    float32 and ``m`` likewise or None (zero). Every ``q + offset`` is in ``0 .. 2^bits - 1``:
    the type's span (Q6_K's q - 32 has bits 6, offset 32; the 8-bit types' bits 8, offset 128,
    so q fits int8)."""

    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None
    group: int
    bits: int
    offset: int = 0

    def dequantize(self) -> torch.Tensor:
        """The float32 weight ``[N, K]`` (what ``gguf.quants.dequantize`` gives)."""
        n, k = self.q.shape
        q = self.q.float().reshape(n, k // self.group, self.group)
        w = q * self.d[..., None]
        if self.m is not None:
            w = w + self.m[..., None]
        return w.reshape(n, k)


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """Pairs of bytes ``[..., 2]`` as float32 values of their float16."""
    return raw.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[..., B]`` bytes -> ``[..., 2B]``: the low nibbles, then the high ones (GGUF's order)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _bits(raw: torch.Tensor, count: int) -> torch.Tensor:
    """``[..., B]`` bytes -> ``[..., count]`` bits, little-endian within each byte."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((raw[..., None] >> shifts) & 1).reshape(*raw.shape[:-1], -1)[..., :count]


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's and Q5_K's 12 bytes of 6-bit scales and minimums -> ``(sc [.., 8], min [.., 8])``."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def split(type_name: str, data: np.ndarray, shape: tuple[int, int]) -> Codes:
    """``data`` (a GGUF tensor's bytes, ``[N, row bytes]`` uint8) of type ``type_name`` as
    ``Codes`` of the weight ``shape = (N, K)``. ``ValueError`` for a type not in
    ``SPLIT_TYPES`` or bytes that do not make ``shape``."""
    if type_name not in _BLOCKS:
        raise ValueError(f"GGUF type {type_name} has no integer split; splittable: {', '.join(SPLIT_TYPES)}")
    block_bytes, per_block = _BLOCKS[type_name]
    n, k = shape
    if k % per_block or data.size != n * (k // per_block) * block_bytes:
        raise ValueError(f"{data.size} bytes of {type_name} do not make a [{n}, {k}] weight")
    raw = torch.from_numpy(np.ascontiguousarray(data).reshape(n, k // per_block, block_bytes))
    q, d, m, group = _SPLITTERS[type_name](raw)
    q = q.reshape(n, k).to(torch.int16)
    d = d.reshape(n, k // group).contiguous()
    m = None if m is None else m.reshape(n, k // group).contiguous()
    return Codes(q, d, m, group, *SPANS[type_name])


Split = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None", int]


def _q4_0(raw: torch.Tensor) -> Split:
    d = _f16(raw[..., 0:2].unsqueeze(-2))
    return _nibbles(raw[..., 2:18]), d, -8 * d, 32


def _q4_1(raw: torch.Tensor) -> Split:
    d, m = _f16(raw[..., 0:2].unsqueeze(-2)), _f16(raw[..., 2:4].unsqueeze(-2))
    return _nibbles(raw[..., 4:20]), d, m, 32


def _q5_high(raw: torch.Tensor, qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    return _nibbles(qs).to(torch.int16) | (_bits(qh, 32).to(torch.int16) << 4)


def _q5_0(raw: torch.Tensor) -> Split:
    d = _f16(raw[..., 0:2].unsqueeze(-2))
    return _q5_high(raw, raw[..., 2:6], raw[..., 6:22]) - 16, d, None, 32


def _q5_1(raw: torch.Tensor) -> Split:
    d, m = _f16(raw[..., 0:2].unsqueeze(-2)), _f16(raw[..., 2:4].unsqueeze(-2))
    return _q5_high(raw, raw[..., 4:8], raw[..., 8:24]), d, m, 32


def _q8_0(raw: torch.Tensor) -> Split:
    d = _f16(raw[..., 0:2].unsqueeze(-2))
    return raw[..., 2:34].contiguous().view(torch.int8), d, None, 32


def _q4_k(raw: torch.Tensor) -> Split:
    d, dmin = _f16(raw[..., 0:2].unsqueeze(-2)), _f16(raw[..., 2:4].unsqueeze(-2))
    sc, mn = _k_scales(raw[..., 4:16])
    # 128 bytes: 4 chunks of 32, low nibbles sub-block 2j, high nibbles 2j + 1
    qs = raw[..., 16:144].reshape(*raw.shape[:-1], 4, 32)
    q = torch.stack([qs & 0x0F, qs >> 4], dim=-2).reshape(*raw.shape[:-1], 256)
    return q, d * sc.float(), -(dmin * mn.float()), 32


def _q5_k(raw: torch.Tensor) -> Split:
    d, dmin = _f16(raw[..., 0:2].unsqueeze(-2)), _f16(raw[..., 2:4].unsqueeze(-2))
    sc, mn = _k_scales(raw[..., 4:16])
    qh = raw[..., 16:48]  # bit j of byte i: value i of sub-block j
    qs = raw[..., 48:176].reshape(*raw.shape[:-1], 4, 32)
    low = torch.stack([qs & 0x0F, qs >> 4], dim=-2).reshape(*raw.shape[:-1], 8, 32).to(torch.int16)
    shifts = torch.arange(8, dtype=torch.uint8)
    high = ((qh[..., None, :] >> shifts[:, None]) & 1).to(torch.int16)  # [.., 8 sub-blocks, 32]
    return (low | (high << 4)).reshape(*raw.shape[:-1], 256), d * sc.float(), -(dmin * mn.float()), 32


def _q6_k(raw: torch.Tensor) -> Split:
    lead = raw.shape[:-1]
    ql = raw[..., 0:128].reshape(*lead, 2, 64)
    qh = raw[..., 128:192].reshape(*lead, 2, 32)
    sc = raw[..., 192:208].contiguous().view(torch.int8).float()
    d = _f16(raw[..., 208:210].unsqueeze(-2))
    low = torch.stack([ql & 0x0F, ql >> 4], dim=-2).reshape(*lead, 2, 4, 32)  # [half, quarter, 32]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)
    high = ((qh[..., None, :] >> shifts[:, None]) & 3)  # [half, quarter, 32]
    q = (low.to(torch.int16) | (high.to(torch.int16) << 4)) - 32
    return q.reshape(*lead, 256), d * sc, None, 16


def _q3_k(raw: torch.Tensor) -> Split:
    lead = raw.shape[:-1]
    hmask = raw[..., 0:32]
    qs = raw[..., 32:96].reshape(*lead, 2, 32)
    scales = raw[..., 96:108]
    d = _f16(raw[..., 108:110].unsqueeze(-2))
    low_s = torch.cat([scales[..., 0:8] & 0x0F, scales[..., 0:8] >> 4], dim=-1)
    hs = scales[..., 8:12]
    high_s = torch.cat([(hs >> s) & 3 for s in (0, 2, 4, 6)], dim=-1)
    sc = (low_s.to(torch.int16) | (high_s.to(torch.int16) << 4)) - 32
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)
    low = ((qs[..., None, :] >> shifts[:, None]) & 3).reshape(*lead, 8, 32)  # [half * 4 + shift, 32]
    hbit = ((hmask[..., None, :] >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1)  # [8, 32]
    q = low.to(torch.int16) - ((1 - hbit.to(torch.int16)) << 2)
    return q.reshape(*lead, 256), d * sc.float(), None, 16


def _q2_k(raw: torch.Tensor) -> Split:
    lead = raw.shape[:-1]
    scales = raw[..., 0:16]
    qs = raw[..., 16:80].reshape(*lead, 2, 32)
    d, dmin = _f16(raw[..., 80:82].unsqueeze(-2)), _f16(raw[..., 82:84].unsqueeze(-2))
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)
    q = ((qs[..., None, :] >> shifts[:, None]) & 3).reshape(*lead, 256)
    return q, d * (scales & 0x0F).float(), -(dmin * (scales >> 4).float()), 16


def _iq4_nl(raw: torch.Tensor) -> Split:
    d = _f16(raw[..., 0:2].unsqueeze(-2))
    values = torch.tensor(IQ4_VALUES, dtype=torch.int16)
    return values[_nibbles(raw[..., 2:18]).long()], d, None, 32


def _iq4_xs(raw: torch.Tensor) -> Split:
    lead = raw.shape[:-1]
    d = _f16(raw[..., 0:2].unsqueeze(-2))
    scales_h = raw[..., 2:4].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF  # [.., 1]
    scales_l = raw[..., 4:8]
    low = torch.cat([scales_l & 0x0F, scales_l >> 4], dim=-1)  # sub-blocks 0,2,4,6 then 1,3,5,7
    low = torch.stack([low[..., :4], low[..., 4:]], dim=-1).reshape(*lead, 8)
    high = (scales_h >> (2 * torch.arange(8))) & 3
    ls = (low.to(torch.int32) | (high << 4)) - 32
    qs = raw[..., 8:136].reshape(*lead, 8, 16)
    values = torch.tensor(IQ4_VALUES, dtype=torch.int16)
    q = values[torch.cat([qs & 0x0F, qs >> 4], dim=-1).long()]
    return q.reshape(*lead, 256), d * ls.float(), None, 32


def _mxfp4(raw: torch.Tensor) -> Split:
    e = raw[..., 0:1].to(torch.int32)
    # 2^(e - 128) built from its bits, as ggml does (e < 2: a subnormal)
    bits = torch.where(e < 2, torch.tensor(0x00200000, dtype=torch.int32) << e, (e - 1) << 23)
    values = torch.tensor(MXFP4_VALUES, dtype=torch.int16)
    return values[_nibbles(raw[..., 1:17]).long()], bits.view(torch.float32), None, 32


_SPLITTERS = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0, "Q4_K": _q4_k,
              "Q5_K": _q5_k, "Q6_K": _q6_k, "Q3_K": _q3_k, "Q2_K": _q2_k, "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs,
              "MXFP4": _mxfp4}

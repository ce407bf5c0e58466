"""The decoder's small per-layer operations: fused C++ kernels with plain-torch twins.

A batch-1 decode step of a small model spends more time dispatching its
dozens of tiny eager ops per layer than computing them. The C++ kernels in
``csrc/`` fuse each chain into one call: ``rowwise.cpp`` (residual add +
RMSNorm, SiLU * up, RoPE + KV-cache write), ``paged_attention.cpp`` (decode
and prompt attention read in place, one arithmetic for both), ``argmax.cpp``,
``fused_layer.cpp`` (a whole decoder layer) and ``grouped_gemm.cpp`` (the
grouped 4-/8-bit GEMMs); ``bindings.cpp`` exports them and ``kernels.h``
declares them. The module is compiled on first use with torch's C++
extension builder (g++ and the Python headers; under a minute, cached under
``~/.cache/kvserve/kernels`` or ``$KVSERVE_KERNEL_CACHE``, one build per CPU
and torch install) and runs on CPU tensors only. Where it cannot be built, or
with ``KVSERVE_KERNELS=0``, every function here falls back to its plain-torch
twin, which the tests compare it against.

The kernels compute in 16-lane vectors (``csrc/vec16.h``): AVX-512 where the
CPU has it, else AVX2, with the same arithmetic on both, so the two builds
give the same results bit for bit. ``KVSERVE_CPU_ISA=avx2`` builds the AVX2
kernels on an AVX-512 CPU, ``avx512bw`` the AVX-512 ones without VNNI,
``avx2-vnni`` the AVX2 ones with AVX-VNNI's dot products (the tests compare
them with the native build); the default, ``native``, builds for the CPU it
runs on.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

from models import kv_cache

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parents[1] / "csrc"  # models/csrc
_SOURCES = sorted(_CSRC.glob("*.cpp"))
_ext: ModuleType | None = None
_tried = False
_enabled = os.environ.get("KVSERVE_KERNELS", "1") != "0"
_amx_usable = False  # set by _check_amx

# KVSERVE_CPU_ISA -> the compiler's target: `native` is this CPU; `avx2` leaves
# AVX-512 out (x86-64-v3: AVX2, FMA, F16C) and `avx512bw` VNNI (Skylake-SP's
# AVX-512), so an AVX-512 VNNI machine can run the kernels those CPUs would;
# `avx2-vnni` is AVX2 with AVX-VNNI's 256-bit vpdpbusd (see _isa_flags).
_ISA_FLAGS = {"native": ["-march=native"], "avx2": ["-march=x86-64-v3", "-mtune=native"],
              "avx512bw": ["-march=skylake-avx512", "-mtune=native"]}
_ISAS = (*_ISA_FLAGS, "avx2-vnni")


def _cpu_flags() -> str:
    """The ``flags`` line of /proc/cpuinfo (the processor's name where there is none)."""
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()


def _isa_flags(isa: str) -> list[str]:
    """The compiler flags of ``isa`` on this CPU.

    ``avx2-vnni`` (the kernels of Alder Lake or Sierra Forest: AVX2 and AVX-VNNI,
    no AVX-512) takes AVX-VNNI where the CPU has it; on an AVX512-VNNI CPU
    without it (Zen 4, Ice Lake) the same 256-bit vpdpbusd in its EVEX form,
    with the vector kernels forced onto AVX2's 16-lane code, so that such a
    CPU can run and test them. Raises ``ValueError`` on a CPU with neither.
    """
    if isa != "avx2-vnni":
        return _ISA_FLAGS[isa]
    flags = set(_cpu_flags().split())
    base = ["-march=x86-64-v3", "-mtune=native"]
    if "avx_vnni" in flags:
        return [*base, "-mavxvnni"]
    if {"avx512_vnni", "avx512vl"} <= flags:
        return [*base, "-mavx512f", "-mavx512vl", "-mavx512vnni", "-mprefer-vector-width=256",
                "-DKVSERVE_FORCE_V16_AVX2"]
    raise ValueError("KVSERVE_CPU_ISA=avx2-vnni needs a CPU with AVX-VNNI or AVX512-VNNI")


def requested_isa() -> str:
    """``KVSERVE_CPU_ISA`` (``native`` unless set): what the kernels are built for."""
    isa = os.environ.get("KVSERVE_CPU_ISA", "native")
    if isa not in _ISAS:
        raise ValueError(f"KVSERVE_CPU_ISA={isa!r}: expected one of {', '.join(_ISAS)}")
    return isa


# A build lock older than this is left by a process killed mid-build (a build
# takes under a minute); torch would wait on it forever.
_STALE_LOCK_SECONDS = 600


def _build_tag() -> str:
    """A short hash of what a build is only valid for: this CPU (-march=native) and this torch install.

    Keying on the install keeps two virtual environments (two checkouts) from
    rebuilding each other's kernels in turn.
    """
    key = "\n".join([_cpu_flags(), torch.__version__, str(Path(torch.__file__).resolve().parent)])
    if requested_isa() != "native":  # the native build keeps the tag it always had
        key += "\n" + requested_isa()
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def _build_directory(name: str) -> Path:
    root = Path(os.environ.get("KVSERVE_KERNEL_CACHE", Path.home() / ".cache" / "kvserve" / "kernels"))
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    lock = path / "lock"
    try:
        if time.time() - lock.stat().st_mtime > _STALE_LOCK_SECONDS:
            logger.warning("removing a stale kernel build lock %s", lock)
            lock.unlink()
    except FileNotFoundError:
        pass
    return path


def sources_digest() -> str:
    """A short hash of the kernels' sources: what they compute changes with it."""
    h = hashlib.sha256()
    for path in sorted(_CSRC.iterdir()):
        if path.suffix in (".cpp", ".h"):
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:12]


def cache_directory() -> Path:
    """This CPU's and torch build's folder in the kernel cache (kernels, tuned choices)."""
    return _build_directory(f"kvserve_cpu_ops_{_build_tag()}")


def _load() -> ModuleType | None:
    global _ext, _tried
    if _tried:
        return _ext
    _tried = True
    t0 = time.perf_counter()
    try:
        from torch.utils.cpp_extension import load

        name = f"kvserve_cpu_ops_{_build_tag()}"
        _ext = load(
            name=name,
            sources=[str(p) for p in _SOURCES],
            extra_cflags=["-O3", *_isa_flags(requested_isa()), "-fopenmp", "-fno-trapping-math", "-fno-math-errno"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(_build_directory(name)),
            verbose=False,
        )
    except Exception as exc:  # no compiler, no headers: run the torch twins instead
        logger.warning("fused CPU kernels unavailable (%s); using plain torch ops", exc)
        _ext = None
    elapsed = time.perf_counter() - t0
    if _ext is not None and elapsed > 2:  # a cached build loads in well under a second
        logger.info("built the fused CPU kernels (%s) in %.0fs (cached for later runs)", _ext.vector_isa(), elapsed)
    if _ext is not None:
        _check_amx(_ext)
    return _ext


def _check_amx(ext: ModuleType) -> None:
    """Offer AMX for the int8-activation GEMMs (``amx_usable``) only if it gives
    the VNNI kernel's results bit for bit on random data, and ``KVSERVE_AMX`` is
    not 0 (or, for tests, on the software tiles of ``set_amx_emulated``, held to
    VNNI's results by the same check). It stays off until chosen
    (``set_amx_enabled``; ``models.autotune`` measures it against VNNI)."""
    global _amx_usable
    _amx_usable = False
    ext.set_amx_enabled(False)
    emulated = ext.amx_emulated()
    if not (emulated or ext.amx_available()):
        return
    if not emulated and _AMX_MODES.get(_amx_setting()) == "off":
        logger.info("AMX: not offered (KVSERVE_AMX=0)")
        return
    gen = torch.Generator().manual_seed(0)
    for bits, rows in ((4, 37), (8, 64)):
        tiles, groups = 5, 7
        x = torch.randn(rows, groups * 32, generator=gen)
        codes = torch.randint(0, 256, (tiles, groups, bits, 64), generator=gen, dtype=torch.uint8)
        scales = torch.rand(tiles, groups, 2, 16, generator=gen)
        outs = []
        for amx in (True, False):
            ext.set_amx_enabled(amx)
            out = torch.empty(rows, tiles * 16 - 3)
            ext.grouped_linear(out, x, codes, scales, True, False)
            outs.append(out)
        if not torch.equal(outs[0], outs[1]):
            logger.warning("AMX: not offered (its %d-bit GEMM differs from VNNI's on the self-check)", bits)
            return  # left disabled by the last pass
    _amx_usable = True
    if emulated:
        logger.info("AMX-INT8 emulated in software (tests): self-check equal to VNNI")
    else:
        logger.info("AMX-INT8: usable (self-check equal to VNNI), offered to the path choice")


def kernels_available() -> bool:
    """Whether the fused kernels are built and loaded (building them on first call)."""
    return _load() is not None


def set_kernels_enabled(enabled: bool) -> None:
    """Turn the fused kernels on or off for this process (tests compare both paths)."""
    global _enabled
    _enabled = enabled


def kernels_enabled(device: torch.device) -> bool:
    """Whether tensors on ``device`` go through the fused kernels (built, enabled, CPU)."""
    return _enabled and device.type == "cpu" and _load() is not None


def _kernels_for(x: torch.Tensor) -> ModuleType | None:
    return _ext if kernels_enabled(x.device) else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim of ``x [T, H]``."""
    ext = _kernels_for(x)
    if ext is not None and x.dim() == 2 and x.stride(1) == 1:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        ext.rms_norm(out, x, weight, eps)
        return out
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    # Variance in float32 for low-precision activations, as the reference does.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual + x`` and its RMSNorm: returns ``(normed, new_residual)``.

    The kernel updates ``residual`` in place, so the caller must own it.
    """
    ext = _kernels_for(x)
    if ext is not None and x.dim() == 2 and x.stride(1) == 1 and residual.is_contiguous():
        out = torch.empty_like(residual)
        ext.add_rms_norm(out, residual, x, weight, eps)
        return out, residual
    residual = residual + x
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where ``gate_up [T, 2I]`` holds gate then up."""
    half = gate_up.shape[-1] // 2
    ext = _kernels_for(gate_up)
    if ext is not None and gate_up.dim() == 2 and gate_up.stride(1) == 1:
        out = gate_up.new_empty(gate_up.shape[0], half)
        ext.silu_and_mul(out, gate_up)
        return out
    gate, up = gate_up.split(half, dim=-1)
    return F.silu(gate) * up


def rotary_and_cache(qkv: torch.Tensor, rotations: torch.Tensor, positions: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                     num_heads: int, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotate the Q and K heads of ``qkv [T, (H + 2 KVH) D]`` and store K and V in their slots.

    ``rotations [P, D/2]`` (complex64) is the whole table, looked up at
    ``positions``. Returns ``q [T, H, D]``, ``k``, ``v [T, KVH, D]`` (rotated).
    """
    t = qkv.shape[0]
    head_dim = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    ext = _kernels_for(qkv)
    fused = ext is not None and qkv.stride(1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    if fused:
        ext.rotary_and_cache(qkv, torch.view_as_real(rotations), positions, k_cache, v_cache,
                             slot_mapping, num_heads, num_kv_heads)
        qk = qkv[:, :q_size + kv_size].view(t, -1, head_dim)
    else:
        # Q and K heads are adjacent in the fused output: rotate them in one call.
        qk = apply_rotary(qkv[:, :q_size + kv_size].view(t, -1, head_dim), rotations[positions].unsqueeze(1))
    q, k = qk.split([num_heads, num_kv_heads], dim=1)
    v = qkv[:, q_size + kv_size:].view(t, num_kv_heads, head_dim)
    if not fused:
        write_kv(k_cache, v_cache, k, v, slot_mapping)
    return q, k, v


# The fused layer's GEMM for a layer's projections (csrc/kernels.h ProjectionGemm): the
# grouped kernel with float or int8 activations, AMX-BF16 on bfloat16 weights, or
# AMX-BF16 on 4-bit weights made bfloat16 in the kernel, or on a GGUF file's own codes
# (amx_quant_linear: row ranges in their formats).
GEMM_GROUPED, GEMM_GROUPED_INT8, GEMM_AMX_BF16, GEMM_AMX_W4A16, GEMM_AMX_QUANT = 0, 1, 2, 3, 4


@dataclass(frozen=True, slots=True)
class FusedWeights:
    """A decoder layer's arguments to ``fused_layer`` that stay the same from step to step:
    its norms, and each projection as its ``(codes, scales)`` multiplied by the GEMM
    ``gemm`` names (``GEMM_*``, one for all four: the projection's ``fused_gemm``)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    qkv: list[torch.Tensor]
    qkv_bias: torch.Tensor | None
    o_proj: list[torch.Tensor]
    gate_up: list[torch.Tensor]
    down: list[torch.Tensor]
    num_heads: int
    num_kv_heads: int
    scale: float
    gemm: int


@dataclass(frozen=True, slots=True)
class FusedStep:
    """What every layer's ``fused_layer`` call in one step shares, prepared once a step.

    The step is ``num_decodes`` decodes (one token per sequence) and then, when
    ``prefill_query_start`` is given, prompt chunks: the remaining sequences'
    tokens, at those offsets (int64, from 0 to their token count) after the
    decode rows. ``rotations``: the RoPE table (complex, as ``RotaryEmbedding`` keeps it).
    """

    rotations: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    num_decodes: int
    prefill_query_start: torch.Tensor | None = None

    def __post_init__(self) -> None:
        # The kernel reads the table as real pairs and the tables as dense rows.
        object.__setattr__(self, "rotations", torch.view_as_real(self.rotations))
        object.__setattr__(self, "block_tables", self.block_tables.contiguous())
        object.__setattr__(self, "context_lens", self.context_lens.contiguous())


def fused_layer(x: torch.Tensor, residual: torch.Tensor | None, weights: FusedWeights, step: FusedStep,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                lora: tuple[list[torch.Tensor], list[int]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole decoder layer for a step in one kernel call; ``(mlp_out, residual)``.

    Float32 activations on CPU. ``lora``: LoRA updates for row ranges
    (``models.lora.LoRABatch.fused_args``). The same arithmetic as the layer's op-by-op path.
    """
    assert _load() is not None, "fused_layer needs the fused CPU kernels"
    w = weights
    out, res = _ext.fused_layer(x, residual, w.input_norm, w.post_norm, w.eps, w.qkv, w.qkv_bias, w.o_proj,
                                w.gate_up, w.down, step.rotations, step.positions, k_cache, v_cache,
                                step.slot_mapping, step.block_tables, step.context_lens, w.num_heads,
                                w.num_kv_heads, w.scale, w.gemm, step.num_decodes, step.prefill_query_start,
                                *(lora or ([], [])))
    return out, res


def grouped_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, out_features: int,
                   int8_activations: bool = False, plain: bool = False) -> torch.Tensor:
    """``x [M, K] @ W^T`` (float32) for a weight packed by ``quant.pack_int4`` or ``quant.pack_int8``.

    ``int8_activations`` rounds every 16 inputs of ``x`` to 8 bits and runs
    integer dot products (see ``has_int8_dots``); ``plain`` takes
    the portable C++ instead of the vector code (for tests).
    """
    if _load() is None:
        raise RuntimeError("grouped_linear needs the fused CPU kernels")
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = x.new_empty(x.shape[0], out_features)
    _ext.grouped_linear(out, x, codes, scales, int8_activations, plain)
    return out


def dense_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """``x [M, K] @ W^T`` for a weight packed by ``dense.pack_dense`` (float32, or bfloat16 for bfloat16 x).

    Each output is one chain of FMAs over the inputs in order, so a row's
    result does not depend on the other rows (MKL's and oneDNN's does).
    """
    if _load() is None:
        raise RuntimeError("dense_linear needs the fused CPU kernels")
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = x.new_empty(x.shape[0], out_features)
    _ext.dense_linear(out, x, packed)
    return out


def amx_usable() -> bool:
    """Whether the int8-activation GEMMs can run on AMX here: the CPU has AMX-INT8,
    the OS granted the tiles, and the start-up self-check matched VNNI bit for bit."""
    return _load() is not None and _amx_usable


def amx_bf16_usable() -> bool:
    """Whether GEMMs can run on AMX-BF16 tiles here (``amx_bf16_linear``): kvserve's
    kernels are on, the CPU has AMX-BF16, the OS granted the tiles, and ``KVSERVE_AMX``
    is not 0."""
    return _enabled and _load() is not None and amx_mode() != "off" and _ext.amx_bf16_available()


def amx_bf16_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """``x [M, K] @ W^T`` in float32 on AMX-BF16 tiles, x's rows rounded to bfloat16 (RNE),
    for a weight packed by ``models.quant.pack_amx_bf16``. A row's result does not depend
    on the other rows; it is this CPU kind's own (tdpbf16ps rounds as the hardware does)."""
    return _amx_linear("amx_bf16_linear", x, out_features, packed)


def amx_w4a16_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, out_features: int) -> torch.Tensor:
    """``x [M, K] @ W^T`` in float32 on AMX-BF16 tiles for 4-bit weights packed by
    ``models.quant.pack_w4a16``: the kernel makes each weight ``d * q + m`` a bfloat16
    and rounds x's rows to bfloat16 (RNE). ``amx_bf16_linear`` on those bfloat16
    weights gives the same bits; a row's result does not depend on the other rows."""
    return _amx_linear("amx_w4a16_linear", x, out_features, codes, scales)


def amx_w8a16_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, out_features: int) -> torch.Tensor:
    """``amx_w4a16_linear`` for 8-bit weights packed by ``models.quant.pack_w8a16``: each
    weight ``d * q`` made a bfloat16 in the kernel."""
    return _amx_linear("amx_w8a16_linear", x, out_features, codes, scales)


def amx_quant_linear(x: torch.Tensor, parts: list[torch.Tensor], formats: list[int], out_features: int
                     ) -> torch.Tensor:
    """``x [M, K] @ W^T`` in float32 on AMX-BF16 tiles for a weight of row ranges, each
    ``(codes, scales)`` in its format (``models.gguf_linear.AMX_FORMATS``; ``parts``: codes0,
    scales0, codes1, ...): each block made bfloat16 in the kernel, x's rows rounded to
    bfloat16 (RNE). A row's result does not depend on the other rows."""
    return _amx_linear("amx_quant_linear", x, out_features, parts, formats)


def repack_gguf(codes: torch.Tensor, scales: torch.Tensor, raw: torch.Tensor, type_id: int, fmt: int,
                source: torch.Tensor) -> bool:
    """Write a GGUF tensor's blocks (``raw [rows, row bytes]`` uint8 of ggml type ``type_id``)
    into ``codes`` and ``scales`` in ``amx_quant_linear``'s format ``fmt``, row ``r`` of the
    weight from ``raw`` row ``source[r]`` (-1: zeros). False where format W4's offsets are
    not exact (nothing else is wrong; take a format with 8-bit codes)."""
    if _load() is None:
        raise RuntimeError("repack_gguf needs the fused CPU kernels")
    return _ext.repack_gguf(codes, scales, raw, type_id, fmt, source)


def _amx_linear(kernel: str, x: torch.Tensor, out_features: int, *weight) -> torch.Tensor:
    # Per call only what is cheap: AmxBf16Linear checked amx_bf16_usable() when it was
    # built, and the kernels refuse a CPU without AMX-BF16 themselves.
    if _load() is None:
        raise RuntimeError(f"{kernel} needs the fused CPU kernels")
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    getattr(_ext, kernel)(out, x, *weight)
    return out


_AMX_MODES = {"0": "off", "1": "auto", "auto": "auto", "": "auto", "force": "force"}


def _amx_setting() -> str:
    return os.environ.get("KVSERVE_AMX", "auto").strip().lower()


def amx_mode() -> str:
    """``KVSERVE_AMX``: ``"off"`` (0: AMX never offered), ``"force"`` (w4a8's dots on
    AMX wherever it is usable, whatever the timing says: to measure that path), or
    ``"auto"`` (unset, 1 or auto: one more candidate for ``models.autotune`` to time).
    ``ValueError`` for any other value."""
    value = _amx_setting()
    if value not in _AMX_MODES:
        raise ValueError(f"KVSERVE_AMX={value!r}: use 0 (off), auto (the default) or force")
    return _AMX_MODES[value]


def amx_enabled() -> bool:
    """Whether int8-activation GEMMs run on AMX tiles now (from grouped_gemm.cpp's
    ``kAmxMinRows`` rows; smaller batches stay on VNNI)."""
    return _load() is not None and _ext.amx_enabled()


def set_amx_enabled(enabled: bool) -> None:
    """Run the int8-activation GEMMs on AMX (where usable) or on VNNI; results are equal."""
    if _load() is not None:
        _ext.set_amx_enabled(enabled and _amx_usable)


def set_amx_emulated(emulated: bool) -> bool:
    """Tests: run the AMX GEMM with its tile instructions done in software
    (grouped_gemm_amx.cpp's ``emu_tile_*``), so that a CPU with AVX512-VNNI but
    no AMX runs the AMX kernel's code; ``False`` gives back the hardware's state.
    The self-check runs again either way (``amx_usable`` says what it found);
    AMX stays off until ``set_amx_enabled``. Returns whether the emulation is
    on: it needs the kernels and AVX512-VNNI."""
    if _load() is None:
        return False
    on = _ext.set_amx_emulated(emulated)
    _check_amx(_ext)
    return on


def amx_hardware() -> bool:
    """Whether the CPU has AMX-INT8 and the OS granted this process the tiles
    (``amx_usable`` also needs the self-check to pass)."""
    return _load() is not None and _ext.amx_available()


def amx_emulated_products() -> int:
    """Tile products (``tdpbsud``) the software tiles of ``set_amx_emulated`` have computed."""
    return _ext.amx_emulated_products() if _load() is not None else 0


def vector_isa() -> str | None:
    """The vectors the kernels run on: ``avx512``, ``avx2``, ``scalar`` (plain
    C++), or None where the kernels are not built."""
    return _ext.vector_isa() if _load() is not None else None


def int8_dots() -> str | None:
    """What ``w4a8``'s integer dot products run on: vpdpbusd on ``avx512-vnni``
    or ``avx-vnni`` (256 bits), else the multiply-adds of ``avx512-bw`` or
    ``avx2`` (the same sums, slower); None where they would run on the plain
    C++ (or the kernels are not built)."""
    return (_ext.int8_dots() or None) if _load() is not None else None


def has_int8_dots() -> bool:
    """Whether int8 activations run as vector integer dot products (``int8_dots``)."""
    return int8_dots() is not None


def apply_rotary(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, H, D]`` (interleaved pairs, any float dtype) by ``rotations [T, 1, D/2]``."""
    t, h, d = x.shape
    xc = torch.view_as_complex(x.float().reshape(t, h, d // 2, 2))
    return torch.view_as_real(xc * rotations).reshape(t, h, d).to(x.dtype)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter new keys/values ``[T, kv_heads, head_dim]`` into their slots (in the caches' format)."""
    num_blocks, block_size, kv_heads, row = k_cache.shape
    for cache, x in ((k_cache, k), (v_cache, v)):
        cache.view(num_blocks * block_size, kv_heads, row).index_copy_(0, slot_mapping,
                                                                      kv_cache.to_cache_rows(x, cache.dtype))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, max_ctx: int,
                     scale: float) -> torch.Tensor:
    """One query token per sequence ``q [B, H, D]`` over its paged context; returns ``[B, H, D]``.

    The caches may hold another dtype than ``q`` (a float16 or int8 cache for float32
    activations; see ``models.kv_cache``).
    """
    ext = _kernels_for(q)
    if (ext is not None and q.stride(2) == 1 and q.stride(1) == q.shape[2]
            and k_cache.is_contiguous() and v_cache.is_contiguous()):
        out = q.new_empty(q.shape)
        ext.paged_decode_attention(out, q, k_cache, v_cache, block_tables.contiguous(),
                                   context_lens.contiguous(), scale)
        return out
    return _decode_attention_torch(q, k_cache, v_cache, block_tables, context_lens, max_ctx, scale)


def _decode_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor, max_ctx: int,
                            scale: float) -> torch.Tensor:
    b, heads, head_dim = q.shape
    block_size = k_cache.shape[1]
    nblocks = kv_cache.cdiv(max_ctx, block_size)
    tables = block_tables[:, :nblocks]
    # [B, L, kv_heads, head_dim] -> [B, kv_heads, L, head_dim]
    # index_select on the flat table is markedly faster than advanced indexing on CPU.
    flat = tables.reshape(-1)
    k, v = (kv_cache.from_cache_rows(c.index_select(0, flat), q.dtype).view(b, -1, c.shape[2], head_dim)
            .transpose(1, 2) for c in (k_cache, v_cache))
    valid = torch.arange(k.shape[2], device=q.device) < context_lens.unsqueeze(1)  # [B, L]
    # One query per sequence: the heads sharing a KV head act as that head's
    # queries, so GQA needs no repeated K/V: [B, kv_heads, group, head_dim].
    qg = q.reshape(b, k.shape[1], heads // k.shape[1], head_dim)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=valid[:, None, None, :], scale=scale)
    return o.reshape(b, heads, head_dim)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for ``x [S, V]``: int64 ``[S]``, the first index on ties, NaN counting as largest."""
    ext = _kernels_for(x)
    if ext is not None and x.dim() == 2 and x.dtype == torch.float32 and x.stride(1) == 1 and x.shape[1] > 0:
        out = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
        ext.argmax_rows(out, x)
        return out
    return x.argmax(dim=-1)


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], masks: torch.Tensor) -> None:
    """Set ``logits[rows[i], t] = -inf`` (in place) wherever bit ``t % 32`` of ``masks[i, t // 32]`` is 0.

    ``logits [S, V]`` float32; ``masks [len(rows), >= ceil(V/32)]`` int32 (a grammar's allowed tokens).
    """
    if not rows:
        return
    ext = _kernels_for(logits)
    if ext is not None and logits.dtype == torch.float32 and logits.stride(1) == 1:
        ext.apply_token_bitmask(logits, torch.tensor(rows, dtype=torch.long), masks.contiguous())
        return
    vocab = logits.shape[1]
    bits = torch.arange(32, dtype=torch.int32, device=masks.device)
    allowed = ((masks.unsqueeze(-1) >> bits) & 1).view(len(rows), -1)[:, :vocab].bool()
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed.to(logits.device), float("-inf"))


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, block_tables: torch.Tensor, query_lens: list[int],
                      context_lens: list[int], scale: float) -> torch.Tensor:
    """Causal attention for sequences of one or more query tokens each; returns ``[T, H, D]``.

    ``q [T, H, D]`` holds the sequences' tokens one sequence after another;
    sequence i's ``query_lens[i]`` tokens are the last of its ``context_lens[i]``
    positions, whose keys and values are already in the paged caches (``k``,
    ``v [T, KVH, D]`` are this step's, which the torch path uses for fresh prompts).
    """
    ext = _kernels_for(q)
    if (ext is not None and q.stride(2) == 1 and q.stride(1) == q.shape[2]
            and k_cache.is_contiguous() and v_cache.is_contiguous()):
        out = q.new_empty(q.shape)
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        ext.paged_prefill_attention(out, q, k_cache, v_cache, block_tables.contiguous(),
                                    torch.tensor(context_lens, dtype=torch.long),
                                    torch.tensor(starts, dtype=torch.long), scale)
        return out
    return _prefill_attention_torch(q, k, v, k_cache, v_cache, block_tables, query_lens, context_lens, scale)


def _prefill_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, block_tables: torch.Tensor, query_lens: list[int],
                             context_lens: list[int], scale: float) -> torch.Tensor:
    out = q.new_empty(q.shape)
    start = 0
    for i, (qlen, ctx) in enumerate(zip(query_lens, context_lens)):
        end = start + qlen
        if ctx == qlen:
            # A fresh prompt: its keys are exactly this step's, no gather needed.
            ks, vs = k[start:end], v[start:end]
        else:
            ks = kv_cache.from_cache_rows(_gather(k_cache, block_tables[i], ctx), q.dtype)
            vs = kv_cache.from_cache_rows(_gather(v_cache, block_tables[i], ctx), q.dtype)
        out[start:end] = _causal_attention(q[start:end], ks, vs, scale)
        start = end
    return out


def _gather(cache: torch.Tensor, block_table: torch.Tensor, ctx: int) -> torch.Tensor:
    """The first ``ctx`` tokens of one sequence, ``[ctx, kv_heads, head_dim]``."""
    block_size = cache.shape[1]
    nblocks = kv_cache.cdiv(ctx, block_size)
    return cache.index_select(0, block_table[:nblocks]).flatten(0, 1)[:ctx]


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Queries are the last ``len(q)`` positions of a context of ``len(k)`` tokens."""
    qlen, ctx = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    if group > 1:
        # NOTE: SDPA's enable_gqa falls back to the slow math kernel on CPU;
        # repeating K/V heads keeps the fused (flash) kernel, about 3x faster.
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, heads, len, head_dim]
    if qlen == ctx:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    else:
        # Query i sits at position ctx - qlen + i and sees keys 0..that position.
        rows = torch.arange(qlen, device=q.device).unsqueeze(1) + (ctx - qlen)
        mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= rows
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return o[0].transpose(0, 1)

"""The instruction-set switches: which vectors the kernels are compiled for
(``KVSERVE_CPU_ISA``) and whether AMX's tiles are offered (``KVSERVE_AMX``).

``native``, the default, builds for the CPU it runs on; ``avx2``, ``avx512bw`` and
``avx2-vnni`` build the kernels of lesser CPUs on this one, so the tests can compare
them with the native build.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path


# KVSERVE_CPU_ISA -> the compiler's target: `native` is this CPU; `avx2` leaves
# AVX-512 out (x86-64-v3: AVX2, FMA, F16C) and `avx512bw` VNNI (Skylake-SP's
# AVX-512), so an AVX-512 VNNI machine can run the kernels those CPUs would;
# `avx2-vnni` is AVX2 with AVX-VNNI's 256-bit vpdpbusd (see isa_flags).
_ISA_FLAGS = {"native": ["-march=native"], "avx2": ["-march=x86-64-v3", "-mtune=native"],
              "avx512bw": ["-march=skylake-avx512", "-mtune=native"]}
_ISAS = (*_ISA_FLAGS, "avx2-vnni")


def cpu_flags() -> str:
    """The ``flags`` line of /proc/cpuinfo (the processor's name where there is none)."""
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()


def isa_flags(isa: str) -> list[str]:
    """The compiler flags of ``isa`` on this CPU.

    ``avx2-vnni`` (the kernels of Alder Lake or Sierra Forest: AVX2 and AVX-VNNI,
    no AVX-512) takes AVX-VNNI where the CPU has it; on an AVX512-VNNI CPU
    without it (Zen 4, Ice Lake) the same 256-bit vpdpbusd in its EVEX form,
    with the vector kernels forced onto AVX2's 16-lane code, so that such a
    CPU can run and test them. Raises ``ValueError`` on a CPU with neither.
    """
    if isa != "avx2-vnni":
        return _ISA_FLAGS[isa]
    flags = set(cpu_flags().split())
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


# KVSERVE_AMX's values -> what they ask for (``amx_mode``).
AMX_MODES = {"0": "off", "1": "auto", "auto": "auto", "": "auto", "force": "force"}


def amx_setting() -> str:
    """``KVSERVE_AMX`` as given (lower case; ``auto`` unset); ``amx_mode`` validates it."""
    return os.environ.get("KVSERVE_AMX", "auto").strip().lower()


def amx_mode() -> str:
    """``KVSERVE_AMX``: ``"off"`` (0: AMX never offered), ``"force"`` (w4a8's dots on
    AMX wherever it is usable, whatever the timing says: to measure that path), or
    ``"auto"`` (unset, 1 or auto: one more candidate for ``models.autotune`` to time).
    ``ValueError`` for any other value."""
    value = amx_setting()
    if value not in AMX_MODES:
        raise ValueError(f"KVSERVE_AMX={value!r}: use 0 (off), auto (the default) or force")
    return AMX_MODES[value]

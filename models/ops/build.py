"""Building and loading the fused CPU kernels, and what the loaded build can do here.

``models/csrc/*.cpp`` is compiled on first use with torch's C++ extension builder
into a folder of the kernel cache keyed by this CPU, this torch install and the
ISA asked for (``cache_directory``), and loaded once per process
(``load_extension``); AMX is offered only after a self-check against VNNI. The
kernels can be turned off (``KVSERVE_KERNELS=0``, ``set_kernels_enabled``): the ops
then run their plain-torch twins.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path
from types import ModuleType

import torch

from models.ops.isa import AMX_MODES, amx_mode, amx_setting, cpu_flags, isa_flags, requested_isa

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parents[1] / "csrc"  # models/csrc
_SOURCES = sorted(_CSRC.glob("*.cpp"))
_ext: ModuleType | None = None
_tried = False
_enabled = os.environ.get("KVSERVE_KERNELS", "1") != "0"
_amx_usable = False  # set by _check_amx


# A build lock older than this is left by a process killed mid-build (a build
# takes under a minute); torch would wait on it forever.
_STALE_LOCK_SECONDS = 600


def _build_tag() -> str:
    """A short hash of what a build is only valid for: this CPU (-march=native) and this torch install.

    Keying on the install keeps two virtual environments (two checkouts) from
    rebuilding each other's kernels in turn.
    """
    key = "\n".join([cpu_flags(), torch.__version__, str(Path(torch.__file__).resolve().parent)])
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


def load_extension() -> ModuleType | None:
    """The kernels' extension module, built and loaded on the first call;
    None where it cannot be built (the ops then run their torch twins)."""
    global _ext, _tried
    if _tried:
        return _ext
    _tried = True
    t0 = time.perf_counter()
    try:
        name = f"kvserve_cpu_ops_{_build_tag()}"
        directory = _build_directory(name)
        cflags = ["-O3", *isa_flags(requested_isa()), "-fopenmp", "-fno-trapping-math", "-fno-math-errno"]
        _ext = _load_built(name, directory, cflags)
        if _ext is None:
            from torch.utils.cpp_extension import load

            _ext = load(name=name, sources=[str(p) for p in _SOURCES], extra_cflags=cflags,
                        extra_ldflags=["-fopenmp"], build_directory=str(directory), verbose=False)
            (directory / _BUILT_FROM).write_text(_built_from(cflags))
    except Exception as exc:  # no compiler, no headers: run the torch twins instead
        logger.warning("fused CPU kernels unavailable (%s); using plain torch ops", exc)
        _ext = None
    elapsed = time.perf_counter() - t0
    if _ext is not None and elapsed > 2:  # a cached build loads in well under a second
        logger.info("built the fused CPU kernels (%s) in %.0fs (cached for later runs)", _ext.vector_isa(), elapsed)
    if _ext is not None:
        _check_amx(_ext)
    return _ext


# A build's record of the sources and flags it was made from (beside its .so).
_BUILT_FROM = "built_from.txt"


def _built_from(cflags: list[str]) -> str:
    return f"{sources_digest()} {' '.join(cflags)}"


def _load_built(name: str, directory: Path, cflags: list[str]) -> ModuleType | None:
    """The build in ``directory`` if it was made from these sources and flags (None: build
    it): imported as torch's builder would, without importing the builder (0.17 s of a start)."""
    import importlib.util

    library = directory / f"{name}.so"
    try:
        if not library.is_file() or (directory / _BUILT_FROM).read_text() != _built_from(cflags):
            return None
    except OSError:
        return None
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    if not emulated and AMX_MODES.get(amx_setting()) == "off":
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
    return load_extension() is not None


def set_kernels_enabled(enabled: bool) -> None:
    """Turn the fused kernels on or off for this process (tests compare both paths)."""
    global _enabled
    _enabled = enabled


def kernels_enabled(device: torch.device) -> bool:
    """Whether tensors on ``device`` go through the fused kernels (built, enabled, CPU)."""
    return _enabled and device.type == "cpu" and load_extension() is not None


def kernels_for(x: torch.Tensor) -> ModuleType | None:
    """The extension where ``x``'s ops go through the kernels (``kernels_enabled``), else None."""
    return _ext if kernels_enabled(x.device) else None


def amx_usable() -> bool:
    """Whether the int8-activation GEMMs can run on AMX here: the CPU has AMX-INT8,
    the OS granted the tiles, and the start-up self-check matched VNNI bit for bit."""
    return load_extension() is not None and _amx_usable


def amx_bf16_usable() -> bool:
    """Whether GEMMs can run on AMX-BF16 tiles here (``amx_bf16_linear``): kvserve's
    kernels are on, the CPU has AMX-BF16, the OS granted the tiles, and ``KVSERVE_AMX``
    is not 0."""
    return _enabled and load_extension() is not None and amx_mode() != "off" and _ext.amx_bf16_available()


def amx_enabled() -> bool:
    """Whether int8-activation GEMMs run on AMX tiles now (from grouped_gemm.cpp's
    ``kAmxMinRows`` rows; smaller batches stay on VNNI)."""
    return load_extension() is not None and _ext.amx_enabled()


def set_amx_enabled(enabled: bool) -> None:
    """Run the int8-activation GEMMs on AMX (where usable) or on VNNI; results are equal."""
    if load_extension() is not None:
        _ext.set_amx_enabled(enabled and _amx_usable)


def set_amx_emulated(emulated: bool) -> bool:
    """Tests: run the AMX GEMM with its tile instructions done in software
    (grouped_gemm_amx.cpp's ``emu_tile_*``), so that a CPU with AVX512-VNNI but
    no AMX runs the AMX kernel's code; ``False`` gives back the hardware's state.
    The self-check runs again either way (``amx_usable`` says what it found);
    AMX stays off until ``set_amx_enabled``. Returns whether the emulation is
    on: it needs the kernels and AVX512-VNNI."""
    if load_extension() is None:
        return False
    on = _ext.set_amx_emulated(emulated)
    _check_amx(_ext)
    return on


def amx_hardware() -> bool:
    """Whether the CPU has AMX-INT8 and the OS granted this process the tiles
    (``amx_usable`` also needs the self-check to pass)."""
    return load_extension() is not None and _ext.amx_available()


def amx_emulated_products() -> int:
    """Tile products (``tdpbsud``) the software tiles of ``set_amx_emulated`` have computed."""
    return _ext.amx_emulated_products() if load_extension() is not None else 0


def vector_isa() -> str | None:
    """The vectors the kernels run on: ``avx512``, ``avx2``, ``scalar`` (plain
    C++), or None where the kernels are not built."""
    return _ext.vector_isa() if load_extension() is not None else None


def int8_dots() -> str | None:
    """What ``w4a8``'s integer dot products run on: vpdpbusd on ``avx512-vnni``
    or ``avx-vnni`` (256 bits), else the multiply-adds of ``avx512-bw`` or
    ``avx2`` (the same sums, slower); None where they would run on the plain
    C++ (or the kernels are not built)."""
    return (_ext.int8_dots() or None) if load_extension() is not None else None


def has_int8_dots() -> bool:
    """Whether int8 activations run as vector integer dot products (``int8_dots``)."""
    return int8_dots() is not None

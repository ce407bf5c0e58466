"""The AVX2 kernels, and AVX-512's without VNNI, compute what this CPU's AVX-512 kernels
compute, bit for bit.

The kernels are written once on 16-lane vectors (models/csrc/vec16.h), so a
CPU without AVX-512 runs the same arithmetic at half the width, and one
without VNNI gets the same integer dots from byte multiply-adds. This test
builds the other kernels (``KVSERVE_CPU_ISA=avx2``: x86-64-v3;
``avx2-vnni``: x86-64-v3 with 256-bit vpdpbusd, as Alder Lake and Sierra
Forest run it; ``avx512bw``: Skylake-SP's AVX-512) in a second process, runs every vector
kernel there (and SmolLM2 on each path the kernels serve, for AVX2), and
compares with this process's build: equal, with no tolerance. It needs an
AVX-512 VNNI CPU to have builds to compare; elsewhere the native build is one
of those, which the rest of the suite tests.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models import ops
from tests.models import isa_outputs

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not ops.kernels_available(), reason="kvserve's CPU kernels are not built here")
needs_vnni = pytest.mark.skipif(
    ops.int8_dots() != "avx512-vnni",
    reason="comparing with AVX-512 VNNI needs such a CPU (this one runs one of the other builds natively)")


def cpu_flags() -> set[str]:
    return set(Path("/proc/cpuinfo").read_text().split())


def test_the_build_uses_the_widest_vectors_the_cpu_has() -> None:
    flags, isa = cpu_flags(), ops.requested_isa()
    if isa == "avx2-vnni" or (isa == "native" and "avx512f" not in flags and "avx_vnni" in flags):
        expected = ("avx2", "avx-vnni")
    elif isa == "avx2" or (isa == "native" and "avx512f" not in flags and {"avx2", "fma", "f16c"} <= flags):
        expected = ("avx2", "avx2")
    elif isa == "avx512bw" or (isa == "native" and "avx512f" in flags and "avx512_vnni" not in flags):
        expected = ("avx512", "avx512-bw")
    elif "avx512f" in flags:
        expected = ("avx512", "avx512-vnni")
    else:
        expected = ("scalar", None)
    assert (ops.vector_isa(), ops.int8_dots()) == expected
    assert ops.has_int8_dots() == (expected[1] is not None)


def out_of_line_gemm_helpers(obj: Path) -> list[str]:
    """The symbols of ``obj`` (a built grouped_gemm.o) that are grouped_gemm.cpp's inner
    helpers, or lambdas inside them."""
    symbols = subprocess.run(["nm", "-C", str(obj)], capture_output=True, text=True, check=True).stdout
    helpers = re.compile(r"\b(load_codes|group_dots|tile_rows|tile_rows_a8|tile_rows_k)<")
    return [line for line in symbols.splitlines() if helpers.search(line)]


def test_the_gemms_inner_helpers_are_inlined() -> None:
    """load_codes, group_dots and the tile functions are forced inline (vec16.h's
    KVSERVE_ALWAYS_INLINE). Left to GCC's inliner they went out of line once the
    kernels stopped including all of torch (84a3546): their vector arrays passed
    through memory and w4a8's GEMM ran 2-2.5x slower. The build is asserted, not
    its speed (timings never gate a test)."""
    assert not out_of_line_gemm_helpers(ops.cache_directory() / "grouped_gemm.o")
    assert not out_of_line_gemm_helpers(ops.cache_directory() / "gguf_a8.o")


def test_an_unknown_isa_is_refused(monkeypatch) -> None:
    monkeypatch.setenv("KVSERVE_CPU_ISA", "avx3")
    with pytest.raises(ValueError, match="KVSERVE_CPU_ISA='avx3': expected one of native, avx2, avx512bw, avx2-vnni"):
        ops.requested_isa()


def outputs_of(isa: str, with_model: bool, tmp_path_factory) -> dict[str, torch.Tensor]:
    """isa_outputs run in a process whose kernels are built for ``isa``."""
    path = tmp_path_factory.mktemp("isa") / f"{isa}.pt"
    env = {**os.environ, "KVSERVE_CPU_ISA": isa}
    argv = [sys.executable, "-m", "tests.models.isa_outputs", str(path)] + (["--model"] if with_model else [])
    subprocess.run(argv, cwd=ROOT, env=env, check=True, timeout=900)
    return torch.load(path, weights_only=True)


@pytest.fixture(scope="module")
def avx2_outputs(tmp_path_factory) -> dict[str, torch.Tensor]:
    return outputs_of("avx2", True, tmp_path_factory)


@pytest.fixture(scope="module")
def avx2_vnni_outputs(tmp_path_factory) -> dict[str, torch.Tensor]:
    # AVX-VNNI's kernels; here vpdpbusd's EVEX form on 256 bits (models.ops.isa.isa_flags).
    return outputs_of("avx2-vnni", False, tmp_path_factory)


@pytest.fixture(scope="module")
def avx512bw_outputs(tmp_path_factory) -> dict[str, torch.Tensor]:
    # The kernels only: the model's paths are the AVX2 build's check (each build costs tens of seconds).
    return outputs_of("avx512bw", False, tmp_path_factory)


@pytest.mark.slow
@needs_vnni
@pytest.mark.parametrize("isa, reports", [("avx2", "avx2 avx2"), ("avx2-vnni", "avx2 avx-vnni"),
                                          ("avx512bw", "avx512 avx512-bw")])
def test_every_kernel_equals_avx512_vnni(isa: str, reports: str, request, monkeypatch) -> None:
    theirs = request.getfixturevalue(f"{isa.replace('-', '_')}_outputs")
    assert bytes(theirs["isa"].tolist()).decode() == reports
    # That build's object keeps the GEMM's helpers inline too (its byte dots are other code).
    with monkeypatch.context() as env:
        env.setenv("KVSERVE_CPU_ISA", isa)
        assert not out_of_line_gemm_helpers(ops.cache_directory() / "grouped_gemm.o")
    mine = isa_outputs.kernel_outputs()
    # (57, 24 sliding-window, 24 soft-capped and 24 sink attentions, 36 GGUF int8-activation GEMMs
    # and 12 of experts in one call)
    assert len(mine) == 177
    differ = [k for k, v in mine.items() if not torch.equal(v, theirs[k])]
    assert not differ, f"{reports} differs from AVX-512 VNNI on {len(differ)} of {len(mine)}: {differ[:5]}"


@pytest.mark.slow
@needs_vnni
def test_the_model_equals_avx512_vnni_on_every_path(avx2_outputs) -> None:
    mine = isa_outputs.model_outputs()
    assert len(mine) == 2 * len(isa_outputs.MODEL_PATHS)
    for key, steps in mine.items():
        assert steps.shape == (6, 12), key  # 6 tokens: id, logprob, 5 x (id, logprob)
        assert torch.equal(steps, avx2_outputs[key]), key

"""The AVX2 kernels compute what the AVX-512 kernels compute, bit for bit.

The kernels are written once on 16-lane vectors (models/csrc/vec16.h), so a
CPU without AVX-512 runs the same arithmetic at half the width. This test
builds the AVX2 kernels (``KVSERVE_CPU_ISA=avx2``) in a second process, runs
every vector kernel and SmolLM2 on each path the kernels serve there, and
compares with this process's AVX-512 build: equal, with no tolerance. It
needs an AVX-512 CPU to have two builds to compare; on an AVX2-only CPU the
native build is the AVX2 one, which the rest of the suite tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models import ops
from tests.models import isa_outputs

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not ops.kernels_available(), reason="kvserve's CPU kernels are not built here")
needs_avx512 = pytest.mark.skipif(
    ops.vector_isa() != "avx512",
    reason="comparing with AVX-512 needs an AVX-512 CPU (this one runs the AVX2 build natively)")


def cpu_flags() -> set[str]:
    return set(Path("/proc/cpuinfo").read_text().split())


def test_the_build_uses_the_widest_vectors_the_cpu_has() -> None:
    flags = cpu_flags()
    if ops.requested_isa() == "avx2":
        expected = "avx2"
    elif "avx512f" in flags:
        expected = "avx512"
    elif {"avx2", "fma", "f16c"} <= flags:
        expected = "avx2"
    else:
        expected = "scalar"
    assert ops.vector_isa() == expected
    assert ops.has_int8_dots() == (expected != "scalar")


def test_an_unknown_isa_is_refused(monkeypatch) -> None:
    monkeypatch.setenv("KVSERVE_CPU_ISA", "avx3")
    with pytest.raises(ValueError, match="KVSERVE_CPU_ISA='avx3': expected one of native, avx2"):
        ops.requested_isa()


@pytest.fixture(scope="module")
def avx2_outputs(tmp_path_factory) -> dict[str, torch.Tensor]:
    path = tmp_path_factory.mktemp("isa") / "avx2.pt"
    env = {**os.environ, "KVSERVE_CPU_ISA": "avx2"}
    subprocess.run([sys.executable, "-m", "tests.models.isa_outputs", str(path), "--model"], cwd=ROOT, env=env,
                   check=True, timeout=900)
    return torch.load(path, weights_only=True)


@pytest.mark.slow
@needs_avx512
def test_the_second_build_is_avx2(avx2_outputs) -> None:
    assert bytes(avx2_outputs["isa"].tolist()).decode() == "avx2"


@pytest.mark.slow
@needs_avx512
def test_every_kernel_equals_avx512(avx2_outputs) -> None:
    mine = isa_outputs.kernel_outputs()
    assert len(mine) == 57
    differ = [k for k, v in mine.items() if not torch.equal(v, avx2_outputs[k])]
    assert not differ, f"AVX2 differs from AVX-512 on {len(differ)} of {len(mine)}: {differ[:5]}"


@pytest.mark.slow
@needs_avx512
def test_the_model_equals_avx512_on_every_path(avx2_outputs) -> None:
    mine = isa_outputs.model_outputs()
    assert len(mine) == 2 * len(isa_outputs.MODEL_PATHS)
    for key, steps in mine.items():
        assert steps.shape == (6, 12), key  # 6 tokens: id, logprob, 5 x (id, logprob)
        assert torch.equal(steps, avx2_outputs[key]), key

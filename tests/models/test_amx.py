"""The int8-activation GEMM on AMX tiles equals the VNNI kernel bit for bit.

Each test runs on the hardware's tiles where the CPU has AMX-INT8, the OS
grants the tile state and the start-up self-check agrees with VNNI
(``ops.amx_usable``), and on software tiles (``ops.set_amx_emulated``: the same
kernel with its tile instructions emulated as the ISA reference defines them)
on any CPU with AVX512-VNNI, so that the AMX kernel's code (operand layouts,
strides, which group's dots meet which scales) is tested on CPUs without AMX
too. Where neither can run, the tests say so.
"""

from __future__ import annotations

import os

import pytest
import torch

from models import autotune, ops
from models.ops import build
from models.quant import pack_int4, pack_int8


@pytest.fixture(params=["hardware", "emulated"])
def tiles(request):
    """AMX usable on the hardware's tiles or the software's; off and not emulated afterwards."""
    emulated = request.param == "emulated"
    try:
        if ops.set_amx_emulated(emulated) != emulated:
            pytest.skip("emulating AMX needs a CPU with AVX512-VNNI and the kernels built")
        if not emulated and not ops.amx_hardware():
            pytest.skip("this CPU offers no AMX-INT8")
        if not emulated and os.environ.get("KVSERVE_AMX") == "0":
            pytest.skip("KVSERVE_AMX=0 keeps AMX out")
        # A kernel the self-check withdrew fails here rather than skipping.
        assert ops.amx_usable(), "the AMX kernel differs from VNNI on the start-up self-check"
        assert not ops.amx_enabled()
        yield request.param
    finally:
        ops.set_amx_emulated(False)
        ops.set_amx_enabled(False)


def both(x: torch.Tensor, packed: tuple[torch.Tensor, torch.Tensor], n: int) -> tuple[torch.Tensor, ...]:
    outs = []
    for amx in (True, False):
        ops.set_amx_enabled(amx)
        assert ops.amx_enabled() is amx
        outs.append(ops.grouped_linear(x, packed[0], packed[1], n, int8_activations=True))
    return tuple(outs)


@pytest.mark.parametrize("rows", [16, 17, 31, 48, 100, 512])
@pytest.mark.parametrize("bits", [4, 8])
def test_amx_gemm_equals_vnni(rows: int, bits: int, tiles: str) -> None:
    gen = torch.Generator().manual_seed(rows * bits)
    n, k = 200, 576  # 13 tiles, the last one partial; 18 groups
    weight = torch.randn(n, k, generator=gen) * 0.05
    packed = (pack_int4 if bits == 4 else pack_int8)(weight)
    x = torch.randn(rows, k, generator=gen)
    products = ops.amx_emulated_products()
    amx, vnni = both(x, packed, n)
    assert torch.equal(amx, vnni)
    # The emulated kernel ran (not VNNI under another name): 2 products per group,
    # 18 groups, per 16-row block and 16-output tile.
    expected = 2 * 18 * -(-rows // 16) * 13 if tiles == "emulated" else 0
    assert ops.amx_emulated_products() - products == expected


def test_a_model_step_on_amx_equals_vnni(tiles: str) -> None:
    from test_autotune import TINY  # the kernels' shapes in miniature

    model = autotune._probe_model(TINY, autotune.RunPath("float32", "w4a8"))
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.int8_activations
    x = torch.randn(40, TINY.hidden_size)
    proj = layer.mlp.gate_up_proj
    amx, vnni = both(x, (proj.codes, proj.group_scales), proj.out_features)
    assert torch.equal(amx, vnni)


@pytest.mark.skipif(not ops.kernels_available(), reason="kvserve's CPU kernels are not built here")
def test_emulation_off_gives_the_hardware_state_back() -> None:
    hardware = ops.amx_usable()
    ops.set_amx_emulated(True)
    assert ops.set_amx_emulated(False) is False  # returns whether the emulation is on
    assert ops.amx_usable() == hardware and not ops.amx_enabled()


@pytest.mark.skipif(not ops.kernels_available(), reason="kvserve's CPU kernels are not built here")
def test_the_self_check_withdraws_amx_that_disagrees(monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    real = build.load_extension()

    class Disagreeing:
        amx = False

        def amx_available(self) -> bool:
            return True

        def amx_emulated(self) -> bool:
            return False

        def set_amx_enabled(self, on: bool) -> None:
            self.amx = on

        def grouped_linear(self, out, x, codes, scales, int8, plain) -> None:
            real.grouped_linear(out, x, codes, scales, int8, plain)
            if self.amx:
                out[0, 0] += 1.0  # one wrong output is enough

    monkeypatch.setattr(build, "_amx_usable", True)
    fake = Disagreeing()
    build._check_amx(fake)
    assert not build._amx_usable and fake.amx is False
    assert "differs from VNNI" in caplog.text

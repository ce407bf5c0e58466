"""The int8-activation GEMM on AMX tiles equals the VNNI kernel bit for bit.

AMX is offered only where the CPU has AMX-INT8, the OS grants the tile state and
the start-up self-check agrees with VNNI (``ops.amx_usable``); elsewhere these
tests cannot run and say so.
"""

from __future__ import annotations

import pytest
import torch

from models import autotune, ops
from models.quant import pack_int4, pack_int8

pytestmark = pytest.mark.skipif(not ops.amx_usable(), reason="this CPU offers no AMX-INT8")


@pytest.fixture
def amx_off_after():
    yield
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
def test_amx_gemm_equals_vnni(rows: int, bits: int, amx_off_after) -> None:
    gen = torch.Generator().manual_seed(rows * bits)
    n, k = 200, 576  # 13 tiles, the last one partial; 18 groups
    weight = torch.randn(n, k, generator=gen) * 0.05
    packed = (pack_int4 if bits == 4 else pack_int8)(weight)
    x = torch.randn(rows, k, generator=gen)
    amx, vnni = both(x, packed, n)
    assert torch.equal(amx, vnni)


def test_a_model_step_on_amx_equals_vnni(amx_off_after) -> None:
    from test_autotune import TINY  # the kernels' shapes in miniature

    model = autotune._probe_model(TINY, autotune.RunPath("float32", "w4a8"))
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.int8_activations
    x = torch.randn(40, TINY.hidden_size)
    proj = layer.mlp.gate_up_proj
    amx, vnni = both(x, (proj.codes, proj.group_scales), proj.out_features)
    assert torch.equal(amx, vnni)


def test_the_self_check_withdraws_amx_that_disagrees(monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    real = ops._ext

    class Disagreeing:
        amx = False

        def amx_available(self) -> bool:
            return True

        def set_amx_enabled(self, on: bool) -> None:
            self.amx = on

        def grouped_linear(self, out, x, codes, scales, int8, plain) -> None:
            real.grouped_linear(out, x, codes, scales, int8, plain)
            if self.amx:
                out[0, 0] += 1.0  # one wrong output is enough

    monkeypatch.setattr(ops, "_amx_usable", False)
    fake = Disagreeing()
    ops._check_amx(fake)
    assert not ops._amx_usable and fake.amx is False
    assert "differs from VNNI" in caplog.text

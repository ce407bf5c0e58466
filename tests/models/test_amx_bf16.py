"""The GEMM on AMX-BF16 tiles (``ops.amx_bf16_linear``) and the ``amx-bf16`` path built on it.

``tdpbf16ps`` rounds as only the hardware does (not as the SDM's pseudocode, so
there is no exact software twin, unlike the AMX-INT8 kernel's): the tests that
run the kernel need a CPU with AMX-BF16 and say so elsewhere. The packing and
the refusals are tested everywhere.
"""

from __future__ import annotations

import pytest
import torch

from models import ops
from models.loader import load_model
from models.quant import AmxBf16Linear, pack_amx_bf16

needs_amx_bf16 = pytest.mark.skipif(not ops.amx_bf16_usable(),
                                    reason="this CPU offers no AMX-BF16 (or KVSERVE_AMX=0)")


def test_the_packing_puts_each_weight_where_tdpbf16ps_reads_it() -> None:
    w = torch.randn(40, 70)
    p = pack_amx_bf16(w)
    assert p.shape == (3, 3, 16, 16, 2) and p.dtype == torch.bfloat16
    wb = w.bfloat16()
    for t, b, pair, o, j in [(0, 0, 0, 0, 0), (1, 2, 2, 5, 1), (2, 1, 15, 7, 0), (0, 2, 2, 15, 1)]:
        row, col = 16 * t + o, 32 * b + 2 * pair + j
        assert p[t, b, pair, o, j] == wb[row, col]
    # Past the weight's 40 rows and 70 inputs: zeros (their products add nothing).
    assert not p[2, :, :, 8:].any() and not p[:, 2, 3:].any()


@needs_amx_bf16
@pytest.mark.parametrize("out_f, in_f", [(960, 576), (576, 1536), (100, 70), (40, 33)])
def test_the_gemm_is_the_bfloat16_product_and_a_row_is_the_same_in_any_batch(out_f: int, in_f: int) -> None:
    gen = torch.Generator().manual_seed(out_f + in_f)
    w = torch.randn(out_f, in_f, generator=gen)
    p = pack_amx_bf16(w)
    x = torch.randn(77, in_f, generator=gen)
    y = ops.amx_bf16_linear(x, p, out_f)
    want = x.bfloat16().double() @ w.bfloat16().double().t()  # the rounded operands, summed exactly
    torch.testing.assert_close(y.double(), want, atol=1e-6 * want.abs().max().item(), rtol=0)
    alone = torch.cat([ops.amx_bf16_linear(x[i:i + 1], p, out_f) for i in range(len(x))])
    assert torch.equal(alone, y)
    assert torch.equal(ops.amx_bf16_linear(x[:17], p, out_f), y[:17])
    assert torch.equal(ops.amx_bf16_linear(torch.cat([x, x]), p, out_f)[77:], y)
    assert torch.equal(ops.amx_bf16_linear(x.bfloat16(), p, out_f), y)  # its inputs are those bfloat16s


@needs_amx_bf16
def test_the_path_runs_fused_and_keeps_the_float_models_greedy_tokens(smollm2, make_runner) -> None:
    amx = load_model("smollm2", "auto", "cpu", quantization="amx-bf16")
    assert amx.dtype == torch.float32
    assert all(isinstance(p, AmxBf16Linear) for layer in amx.model.model.layers
               for p in (layer.self_attn.qkv_proj, layer.mlp.down_proj))
    assert all(layer.packed_int4() for layer in amx.model.model.layers)  # one fused call per layer
    prompt = amx.tokenizer.encode("The history of the printing press begins in the fifteenth century, when")
    want = make_runner(smollm2.model).greedy(prompt, 16)
    runner = make_runner(amx.model)
    assert runner.greedy(prompt, 16) == want
    # Teacher-forced along the float model's tokens: the logits stay close (they span +-20).
    seq = runner.new_seq(len(prompt) + len(want))
    ref_runner = make_runner(smollm2.model)
    ref_seq = ref_runner.new_seq(len(prompt) + len(want))
    got = torch.cat(runner.step([(seq, prompt + want)]))
    ref = torch.cat(ref_runner.step([(ref_seq, prompt + want)]))
    diff = (got - ref).abs().max().item()
    print(f"\nmax logit difference from the float model: {diff:.3f}")
    assert diff < 1.0  # 0.35 measured on a Xeon with AMX


def test_the_path_is_refused_where_it_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="float32"):
        load_model("smollm2", "bfloat16", "cpu", quantization="amx-bf16")
    monkeypatch.setattr(ops, "amx_bf16_usable", lambda: False)
    with pytest.raises(ValueError, match="AMX-BF16"):
        load_model("smollm2", "auto", "cpu", quantization="amx-bf16")
    with pytest.raises(ValueError, match="AMX-BF16"):
        AmxBf16Linear(torch.nn.Linear(32, 16))

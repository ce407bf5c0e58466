"""The GEMMs on AMX-BF16 tiles (``ops.amx_bf16_linear``, ``ops.amx_w4a16_linear``) and the
``amx-bf16`` and ``w4a16`` paths built on them.

``tdpbf16ps`` rounds as only the hardware does (not as the SDM's pseudocode, so
there is no exact software twin, unlike the AMX-INT8 kernel's): the tests that
run the kernel need a CPU with AMX-BF16 and say so elsewhere. The packing and
the refusals are tested everywhere.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from models import ops
from models.loader import load_model
from models.quant import AmxBf16Linear, pack_amx_bf16, pack_int4, pack_int8, pack_w4a16, pack_w8a16

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


def w4a16_codes(codes: torch.Tensor) -> torch.Tensor:
    """pack_w4a16's codes read back as q [N (padded), K], by the layout its docstring gives."""
    tiles, groups = codes.shape[:2]
    c = codes.reshape(tiles, groups, 4, 16, 4).long()  # [tile, group, word v, lane, byte r]
    q = torch.empty(tiles, groups, 16, 32, dtype=torch.long)
    for v in range(4):
        for r in range(4):
            for lane in range(16):
                col = 2 * (4 * v + r) + lane % 2
                q[:, :, lane // 2, col] = c[:, :, v, lane, r] & 15
                q[:, :, 8 + lane // 2, col] = c[:, :, v, lane, r] >> 4
    return q.permute(0, 2, 1, 3).reshape(tiles * 16, groups * 32)


def w4a16_weights(codes: torch.Tensor, scales: torch.Tensor, out_f: int) -> torch.Tensor:
    """The float32 weights the kernel makes: (1 + q/16) * D + M with one rounding (the
    product and sum are exact in float64), as [out_f, K]."""
    q = w4a16_codes(codes).double()
    d = scales[:, :, 0].permute(0, 2, 1).reshape(-1, scales.shape[1]).repeat_interleave(32, 1).double()
    m = scales[:, :, 1].permute(0, 2, 1).reshape(-1, scales.shape[1]).repeat_interleave(32, 1).double()
    return ((1 + q / 16) * d + m).float()[:out_f]


def test_the_4_bit_packing_keeps_the_q4_codes_and_their_weights() -> None:
    w = torch.randn(40, 96)
    codes, scales = pack_w4a16(w)
    assert codes.shape == (3, 3, 4, 64) and codes.dtype == torch.uint8 and scales.shape == (3, 3, 2, 16)
    # The codes are pack_int4's (a Q4_1 weight keeps its own), in another byte order.
    int4_codes, int4_scales = pack_int4(w)
    c = int4_codes.reshape(3, 3, 4, 16, 4).long()  # [tile, group, word, row, byte]: inputs 4w+b, 16+4w+b
    q = torch.cat([(c & 15).permute(0, 3, 1, 2, 4).reshape(3, 16, 3, 16),
                   (c >> 4).permute(0, 3, 1, 2, 4).reshape(3, 16, 3, 16)], dim=-1).reshape(48, 96)
    assert torch.equal(w4a16_codes(codes), q)
    d, m = int4_scales[:, :, 0], int4_scales[:, :, 1]
    assert torch.equal(scales[:, :, 0], 16 * d) and torch.equal(scales[:, :, 1], m - 16 * d)
    # The weights the kernel makes are the 4-bit ones: d * q + m up to float32 rounding.
    dq = (d.permute(0, 2, 1).reshape(48, 3).repeat_interleave(32, 1) * q
          + m.permute(0, 2, 1).reshape(48, 3).repeat_interleave(32, 1))[:40]
    torch.testing.assert_close(w4a16_weights(codes, scales, 40), dq, atol=1e-6, rtol=0)
    torch.testing.assert_close(dq, w, atol=(w.abs().max() / 15).item(), rtol=0)  # within half a step


def w8a16_weights(codes: torch.Tensor, scales: torch.Tensor, out_f: int) -> torch.Tensor:
    """pack_w8a16's weights d * q (one float32 rounding) as [out_f, K], by its layout."""
    tiles, groups = codes.shape[:2]
    c = codes.reshape(tiles, groups, 16, 2, 8, 2).double()  # [tile, group, pair, half, output, j]
    q = c.permute(0, 3, 4, 1, 2, 5).reshape(tiles * 16, groups * 32)
    d = scales.permute(0, 2, 1).reshape(tiles * 16, groups).repeat_interleave(32, 1).double()
    return (d * q).float()[:out_f]


def test_the_8_bit_packing_keeps_the_q8_codes() -> None:
    w = torch.randn(40, 96)
    codes, scales = pack_w8a16(w)
    assert codes.shape == (3, 3, 16, 32) and codes.dtype == torch.int8 and scales.shape == (3, 3, 16)
    int8_codes, int8_scales = pack_int8(w)  # unsigned codes q + 128, 4 inputs of a row per word
    q = (int8_codes.reshape(3, 3, 8, 16, 4).long() - 128).permute(0, 3, 1, 2, 4).reshape(48, 96)
    d = int8_scales[:, :, 0].permute(0, 2, 1).reshape(48, 3).repeat_interleave(32, 1)
    torch.testing.assert_close(w8a16_weights(codes, scales, 40), (d * q)[:40], atol=0, rtol=0)
    torch.testing.assert_close(w8a16_weights(codes, scales, 40), w, atol=(w.abs().max() / 254).item(), rtol=0)


QUANT_GEMMS = {  # weight form -> (packing, its weights as float32, the kernel)
    "w4a16": (pack_w4a16, w4a16_weights, ops.amx_w4a16_linear),
    "w8a16": (pack_w8a16, w8a16_weights, ops.amx_w8a16_linear),
}


@needs_amx_bf16
@pytest.mark.parametrize("form, out_f, in_f", [("w4a16", 960, 576), ("w4a16", 576, 1536), ("w4a16", 3072, 576),
                                               ("w4a16", 100, 64), ("w4a16", 40, 32), ("w8a16", 49152, 576),
                                               ("w8a16", 100, 64), ("w8a16", 40, 32)])
def test_the_quantised_gemms_are_the_bfloat16_gemm_on_their_weights_in_any_batch(form: str, out_f: int,
                                                                                  in_f: int) -> None:
    pack, weights, gemm = QUANT_GEMMS[form]
    gen = torch.Generator().manual_seed(out_f * in_f)
    w = torch.randn(out_f, in_f, generator=gen) * 0.05
    codes, scales = pack(w)
    dense = pack_amx_bf16(weights(codes, scales, out_f))
    x = torch.randn(77, in_f, generator=gen)
    y = gemm(x, codes, scales, out_f)
    # The same tile products on the same bfloat16 operands: the same bits, whether the
    # kernel made the weights per block (up to 16 rows) or per tile pair (more).
    assert torch.equal(y, ops.amx_bf16_linear(x, dense, out_f))
    alone = torch.cat([gemm(x[i:i + 1], codes, scales, out_f) for i in range(len(x))])
    assert torch.equal(alone, y)
    for rows in (3, 16, 17, 33):
        assert torch.equal(gemm(x[:rows], codes, scales, out_f), y[:rows])
    assert torch.equal(gemm(torch.cat([x, x, x, x]), codes, scales, out_f)[231:], y)


@needs_amx_bf16
@pytest.mark.parametrize("method", ["amx-bf16", "w4a16"])
def test_the_path_runs_fused_and_keeps_the_float_models_greedy_tokens(smollm2, make_runner, method: str) -> None:
    amx = load_model("smollm2", "auto", "cpu", quantization=method)
    assert amx.dtype == torch.float32
    # w4a16 on a GGUF file keeps the file's own codes (Q4_1 projections, a Q8_0 head).
    kind, head = ("amx-bf16", "w8a16") if method == "amx-bf16" else ("native", "native")
    assert all(p.kind == kind for layer in amx.model.model.layers
               for p in (layer.self_attn.qkv_proj, layer.mlp.down_proj))
    assert all(layer.packed_int4() for layer in amx.model.model.layers)  # one fused call per layer
    assert amx.model.lm_head.kind == head
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
    assert diff < 1.0  # 0.35 measured on a Xeon with AMX (both paths)


@pytest.mark.parametrize("method", ["amx-bf16", "w4a16"])
def test_the_path_is_refused_where_it_cannot_run(monkeypatch: pytest.MonkeyPatch, method: str) -> None:
    with pytest.raises(ValueError, match="float32"):
        load_model("smollm2", "bfloat16", "cpu", quantization=method)
    monkeypatch.setattr(ops, "amx_bf16_usable", lambda: False)
    with pytest.raises(ValueError, match="AMX-BF16"):
        load_model("smollm2", "auto", "cpu", quantization=method)
    with pytest.raises(ValueError, match="AMX-BF16"):
        AmxBf16Linear(torch.nn.Linear(32, 16), method)


@needs_amx_bf16
@pytest.mark.parametrize("kind", ["amx-bf16", "w4a16", "w8a16"])
def test_the_gemms_let_other_threads_run_while_they_compute(kind: str) -> None:
    # The server's HTTP thread streams tokens while a step computes: every long kernel
    # releases the GIL (the LM head's w8a16 GEMM once held it, 5 ms of a 64-sequence step).
    # While a call holds the GIL no other thread runs Python, so none of this thread's
    # ticks falls in the call's first half (from 5 ms in: the Python before it; after a
    # held call this thread may get a few in while the worker waits for the GIL back);
    # released, they come every half millisecond or so (about 70 in that half here).
    layer = AmxBf16Linear(torch.nn.Linear(576, 16384, bias=False), kind)
    x = torch.randn(2048, 576)
    span: list[float] = []
    done = threading.Event()

    def work() -> None:
        span.append(time.perf_counter())
        layer(x)
        span.append(time.perf_counter())
        done.set()

    worker = threading.Thread(target=work)
    ticks: list[float] = []
    worker.start()
    while not done.is_set():
        time.sleep(0.0005)
        ticks.append(time.perf_counter())
    worker.join()
    inside = [t for t in ticks if span[0] + 0.005 < t < (span[0] + span[1]) / 2]
    assert span[1] - span[0] > 0.02, "the call was too short to tell"
    assert len(inside) >= 3, (len(inside), span[1] - span[0])

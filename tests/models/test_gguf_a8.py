"""A GGUF file's own codes and scales on the int8-activation GEMMs (``--quantization w4a8``).

Each type's repacked codes and scales give the file's weights exactly (a row of x that is
127 at one input reads one column of the weight); a projection's output is the integer-dot
arithmetic csrc/gguf_a8.cpp states, computed here in float64 from the same rounded x; the
vector code gives the plain C++'s bits and a row's result does not depend on the rows
beside it; and a whole model of mixed types loads that way, runs in the fused layer, stays
near the exact path and answers the same in one prefill as in chunks.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from gguf_files import MIXED_TYPES, write_mixed_gguf
from models import ops
from models.gguf_linear import (A8_A4, A8_A5, A8_D4, A8_D5, A8_D8, A8_K2, A8_K3, A8_K4, A8_K5, A8_S16,
                                A8_TYPE_FORMATS, NativeA8Linear)
from models.gguf_native import a8_projection, a8_ready, file_types
from models.gguf_quants import random_blocks, split
from models.gguf_reader import GGUFTensor
from models.loader import load_model
from models.gguf_loader import open_gguf

pytestmark = pytest.mark.skipif(not ops.kernels_available(), reason="the int8-activation GEMMs are C++ kernels")

SHAPE = (48, 512)
TYPES = sorted(A8_TYPE_FORMATS)


def tensor_of(type_name: str, shape: tuple[int, int] = SHAPE, seed: int = 1) -> GGUFTensor:
    n, k = shape
    raw = random_blocks(type_name, shape, seed, one_scale=True)
    return GGUFTensor(f"t.{type_name}", int(GGMLQuantizationType[type_name]), (k, n), raw)


def weight_of(tensor: GGUFTensor) -> torch.Tensor:
    k, n = tensor.shape
    return split(GGMLQuantizationType(tensor.tensor_type).name, tensor.data, (n, k)).dequantize()


def integer_dot_reference(tensor: GGUFTensor, x: torch.Tensor) -> torch.Tensor:
    """csrc/gguf_a8.cpp's arithmetic in float64: the rounded x meets the weights centred on the
    middle code (o, a group's weight there: 0 for the symmetric types), o meets x itself."""
    k, n = tensor.shape
    codes = split(GGMLQuantizationType(tensor.tensor_type).name, tensor.data, (n, k))
    o = codes.d.double() * (2 ** (codes.bits - 1) - codes.offset) + (0 if codes.m is None else codes.m.double())
    if codes.bits == 2:  # (Q2_K: its codes 0..3 and its m per 16 meet the rounded x, as in llama.cpp)
        o = torch.zeros_like(o)
    o = o.repeat_interleave(codes.group, dim=1)
    q, dx = rounded(x)
    w = codes.dequantize().double()
    return (q.double() * dx.double()) @ (w - o).T + x.double() @ o.T


def rounded(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x's rows as the kernels round them: per 16 inputs dx = max|x| / 127, qx = nearest(x / dx)."""
    halves = x.reshape(x.shape[0], -1, 16)
    amax = halves.abs().amax(-1, keepdim=True)
    q = torch.round(halves * torch.where(amax > 0, 127.0 / amax, 0.0))
    return q.reshape(x.shape), (amax / 127.0).expand_as(halves).reshape(x.shape)


# Bits a weight of codes and scales each type is held at: the file's own (the K-quants' and
# IQ4_XS's super-block scales as the file's float16 values, their 6-bit scales as int8s; Q3_K's
# super-block d beside its 16 scales: 0.125 bits a weight over the file's).
HELD_BITS = {"Q4_0": 4.5, "Q4_1": 5.0, "Q5_0": 5.5, "Q5_1": 6.0, "Q8_0": 8.5, "Q4_K": 4.625, "Q5_K": 5.625,
             "Q6_K": 6.5625, "Q3_K": 3.5625, "MXFP4": 4.25, "IQ4_NL": 4.5, "IQ4_XS": 4.3125, "Q2_K": 2.625}


@pytest.mark.parametrize("type_name", TYPES)
def test_each_type_is_held_near_its_files_bits(type_name: str) -> None:
    linear = a8_projection(None, [tensor_of(type_name)], [None])
    held = sum(t.numel() * t.element_size() for t in linear.fused_args[:-1])
    assert held * 8 / (SHAPE[0] * SHAPE[1]) == HELD_BITS[type_name]


@pytest.mark.parametrize("type_name", TYPES)
def test_the_repacked_codes_are_the_files_weights(type_name: str) -> None:
    t = tensor_of(type_name)
    linear = a8_projection(None, [t], [None])
    assert linear.formats == [A8_TYPE_FORMATS[type_name]]
    k = SHAPE[1]
    # 127 at input j: x rounds to itself (dx = 1), so y / 127 is column j of the weight, up to
    # the float sums (an offset's c d + m)
    y = linear(127.0 * torch.eye(k)) / 127.0
    w = weight_of(t).T
    torch.testing.assert_close(y, w, rtol=1e-6, atol=1e-7 * w.abs().max())


@pytest.mark.parametrize("type_name", TYPES)
def test_a_projection_is_the_integer_dot_arithmetic(type_name: str) -> None:
    t = tensor_of(type_name, seed=2)
    linear = a8_projection(None, [t], [None])
    x = torch.randn(40, SHAPE[1], generator=torch.Generator().manual_seed(3))
    y = linear(x)
    want = integer_dot_reference(t, x)  # the kernel rounds only its float sums
    scale = (x.double().abs() @ weight_of(t).double().abs().T).max()
    assert ((y.double() - want).abs().max() / scale).item() < 1e-5
    plain = ops.gguf_a8_linear(x, linear._parts, linear.formats, linear.out_features, plain=True)
    assert torch.equal(plain, y)
    assert ((plain.double() - want).abs().max() / scale).item() < 1e-5
    for rows in (1, 5, 16, 17, 33):  # a row's result does not depend on the rows beside it
        assert torch.equal(linear(x[:rows]), y[:rows])


def test_q3_k_at_three_bits_gives_its_six_bit_codes_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    # K3 holds Q3_K's codes in 3 bits where S16 held them in 6 (u = q + 4 against q + 32): the
    # integer dots less the centre are the same integers, so the same results, bit for bit.
    t = tensor_of("Q3_K", (64, 768), seed=4)
    k3 = a8_projection(None, [t], [None])
    monkeypatch.setitem(A8_TYPE_FORMATS, "Q3_K", A8_S16)
    s16 = a8_projection(None, [t], [None])
    assert (k3.formats, s16.formats) == ([A8_K3], [A8_S16])
    x = torch.randn(37, 768, generator=torch.Generator().manual_seed(6))
    for rows in (1, 4, 37):
        assert torch.equal(k3(x[:rows]), s16(x[:rows]))


def test_mxfp4s_smallest_exponents_are_exact_or_refused() -> None:
    # MX4 keeps the file's E8M0 byte e and makes d = 2^(e - 128) in the kernel: e = 1 gives a
    # subnormal d exactly; e = 0 (2^-128) is made 0, right for a block of zeros only.
    raw = random_blocks("MXFP4", (16, 512), 3, one_scale=True)
    raw[:, 0::17] = np.arange(16, dtype=np.uint8)[:, None] % 3  # (e = 0, 1, 2 by row)
    codes = np.arange(raw.shape[1]) % 17 != 0
    raw[0::3][:, codes] = 0  # (e = 0 rows: every code +0)
    t = GGUFTensor("t", int(GGMLQuantizationType.MXFP4), (512, 16), raw)
    linear = a8_projection(None, [t], [None])
    w = weight_of(t).T
    assert torch.equal(linear(127.0 * torch.eye(512)) / 127.0, w)  # (the values are powers of two)
    raw[0, 5] = 0x11  # a nonzero code in an e = 0 block: d = 2^-128 would be lost
    with pytest.raises(ValueError, match="scales do not match their dequantisation"):
        a8_projection(None, [GGUFTensor("t", int(GGMLQuantizationType.MXFP4), (512, 16), raw)], [None])


def test_parts_of_one_format_share_a_segment_and_others_keep_theirs() -> None:
    parts = [tensor_of("Q4_K", (32, 512)), tensor_of("Q4_K", (16, 512), 2), tensor_of("Q6_K", (16, 512), 3),
             tensor_of("Q8_0", (16, 512), 4), tensor_of("Q4_0", (16, 512), 5), tensor_of("Q5_K", (16, 512), 6)]
    linear = a8_projection(None, parts, [None] * len(parts))
    assert linear.formats == [A8_K4, A8_S16, A8_D8, A8_D4, A8_K5]
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(7))
    want = torch.cat([integer_dot_reference(p, x) for p in parts], dim=1)
    y = linear(x)
    assert ((y.double() - want).abs().max() / want.abs().max()).item() < 1e-5
    start = 0
    for p in parts:  # (all segments' tiles go out to the threads in one pass: each part's own bits)
        alone = a8_projection(None, [p], [None])(x)
        assert torch.equal(y[:, start:start + alone.shape[1]], alone)
        start += alone.shape[1]
    order = torch.randperm(32, generator=torch.Generator().manual_seed(8))
    permuted = a8_projection(None, parts[:1], [order])  # rows read in the order given
    assert torch.equal(permuted(x), linear(x)[:, order])


def test_a_shape_off_the_tiles_is_refused() -> None:
    with pytest.raises(ValueError, match="not whole 16-row tiles"):
        a8_projection(None, [tensor_of("Q4_K", (24, 512))], [None])


@pytest.mark.parametrize("types", [("Q4_K", "Q5_K"), ("Q6_K",), ("MXFP4", "IQ4_XS"), ("Q3_K",), ("Q4_0", "Q8_0"),
                                   ("Q4_K", "Q5_1"), ("Q4_1",), ("Q5_0",)])
def test_experts_in_one_call_give_each_experts_own_call(types: tuple[str, ...]) -> None:
    # Six experts' projections (segments of one or two formats) as one weight: each expert's
    # rows are what its own projection gives them, bit for bit, on the vector code and the plain.
    # (Q4_0, Q8_0, Q5_0: D4, D8, D5; Q4_1, Q5_1: A4, A5)
    projections = [a8_projection(None, [tensor_of(t, (32 * (i + 1), 512), 10 * e + i) for i, t in enumerate(types)],
                                 [None] * len(types)) for e in range(6)]
    n = projections[0].out_features
    weights = ops.a8_experts([t for p in projections for t in p.fused_args[:-1]], projections[0].formats, 6, 512, n)
    x = torch.randn(23, 512, generator=torch.Generator().manual_seed(4))
    ids, counts = [0, 2, 3, 5], [1, 17, 4, 1]
    y = ops.gguf_a8_experts(x, weights, ids, counts, n)
    starts = [0, 1, 18, 22, 23]
    for e, a, b in zip(ids, starts, starts[1:]):
        assert torch.equal(y[a:b], projections[e](x[a:b]))
    plain = ops.gguf_a8_experts(x, weights, ids, counts, n, plain=True)
    for e, a, b in zip(ids, starts, starts[1:]):  # (grouped_linear's plain C++ sums in another order)
        want = ops.gguf_a8_linear(x[a:b], projections[e].fused_args[:-1], projections[e].formats, n, plain=True)
        assert torch.equal(plain[a:b], want)
    # one token's row for each of its experts: the row read three times (a stride of 0)
    alone = ops.gguf_a8_experts(x[:1].expand(3, -1), weights, [1, 2, 4], [1, 1, 1], n)
    assert torch.equal(alone, torch.cat([projections[e](x[:1]) for e in (1, 2, 4)]))


def test_experts_of_other_formats_shapes_or_counts_are_refused() -> None:
    q8 = a8_projection(None, [tensor_of("Q8_0", (32, 512))], [None])
    with pytest.raises(RuntimeError, match="format 13 is not an A8Format"):
        ops.a8_experts(q8.fused_args[:-1], [13], 1, 512, 32)
    with pytest.raises(RuntimeError, match="format 13 is not an A8Format"):
        ops.a8_empty(13, 2, 16)
    with pytest.raises(RuntimeError, match="whole super-blocks of 256"):  # (Q4_K's records per 256 inputs)
        ops.a8_empty(A8_K4, 2, 12)
    with pytest.raises(RuntimeError, match="codes of the wrong width"):  # (Q8_0's 8-bit codes called A4)
        ops.a8_experts(q8.fused_args[:-1], [A8_A4], 1, 512, 32)
    two = [a8_projection(None, [tensor_of("Q4_K", (rows, 512))], [None]) for rows in (32, 48)]
    with pytest.raises(RuntimeError, match="not the shape of expert 0's"):
        ops.a8_experts([t for p in two for t in p.fused_args[:-1]], two[0].formats, 2, 512, 32)
    weights = ops.a8_experts(two[0].fused_args[:-1], two[0].formats, 1, 512, 32)
    with pytest.raises(RuntimeError, match="row counts add to 3, x has 4"):
        ops.gguf_a8_experts(torch.zeros(4, 512), weights, [0], [3], 32)
    with pytest.raises(RuntimeError, match="expert 1 with 4 rows"):
        ops.gguf_a8_experts(torch.zeros(4, 512), weights, [1], [4], 32)


# --- whole models ------------------------------------------------------------------------

# A Q4_K_M-like layer, then two of the other types a format holds.
A8_TYPES = [MIXED_TYPES[0], {"attn_q": "Q5_K", "attn_k": "Q8_0", "attn_v": "Q5_0", "attn_output": "Q4_0",
                             "ffn_gate": "Q3_K", "ffn_up": "Q4_1", "ffn_down": "IQ4_NL"},
            {"attn_q": "Q5_1", "attn_k": "Q5_1", "attn_v": "Q8_0", "attn_output": "IQ4_XS",
             "ffn_gate": "Q2_K", "ffn_up": "Q5_1", "ffn_down": "Q5_1"}]


@pytest.fixture(scope="module")
def a8_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("a8") / "qwen2.gguf"
    return path, write_mixed_gguf(path, arch="qwen2", types=A8_TYPES)


PROMPT = torch.randint(256, (37,), generator=torch.Generator().manual_seed(5)).tolist()


def test_w4a8_keeps_each_tensor_at_its_type(a8_file, make_runner, monkeypatch: pytest.MonkeyPatch) -> None:
    path, reference = a8_file
    model = load_model(str(path), "float32", "cpu", quantization="w4a8").model
    layers = model.model.layers
    assert all(isinstance(p, NativeA8Linear) for layer in layers
               for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj))
    assert [layer.self_attn.qkv_proj.formats for layer in layers] == [[A8_K4, A8_S16], [A8_K5, A8_D8, A8_D5],
                                                                       [A8_A5, A8_D8]]
    assert layers[1].mlp.gate_up_proj.formats == [A8_K3, A8_A4]  # (Q3_K's gate beside Q4_1's up)
    assert layers[2].mlp.gate_up_proj.formats == [A8_K2, A8_A5]  # (Q2_K's gate beside Q5_1's up)
    assert isinstance(model.lm_head, NativeA8Linear) and model.lm_head.formats == [A8_S16]
    assert all(layer.packed_int4() for layer in layers)  # the fused layer runs them
    runner = make_runner(model)
    ours = runner.step([(runner.new_seq(len(PROMPT)), PROMPT)])[0]
    chunked = make_runner(model)
    seq = chunked.new_seq(len(PROMPT))
    parts = [chunked.step([(seq, part)])[0] for part in (PROMPT[:7], PROMPT[7:16], PROMPT[16:])]
    assert torch.equal(torch.cat(parts), ours)  # chunks give one prefill's bits
    with torch.no_grad():
        want = copy.deepcopy(reference).double()(torch.tensor([PROMPT])).logits[0]
    # only x's rounding to int8 per 16 inputs apart from the float model: nearer to it than
    # w4a8 was when it requantised every projection to 4 bits (logits span +-3.5; measured: 0.17
    # against 2.66)
    monkeypatch.setattr("models.gguf_native.a8_ready", lambda types, reader: "forced by the test")
    old = load_model(str(path), "float32", "cpu", quantization="w4a8").model
    assert not isinstance(old.model.layers[0].self_attn.qkv_proj, NativeA8Linear)
    runner = make_runner(old)
    old = runner.step([(runner.new_seq(len(PROMPT)), PROMPT)])[0]
    diff, old_diff = (ours.double() - want).abs().max().item(), (old.double() - want).abs().max().item()
    assert diff < old_diff / 4, f"max |logit diff| from transformers (float64): {diff:.3f}, requantised {old_diff:.3f}"


def test_w4a8_with_bfloat16_activations_runs_op_by_op(a8_file, make_runner) -> None:
    path, _ = a8_file
    model = load_model(str(path), "bfloat16", "cpu", quantization="w4a8").model
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, NativeA8Linear)
    runner = make_runner(model)
    logits = runner.step([(runner.new_seq(len(PROMPT)), PROMPT)])[0]
    assert model.model.norm.weight.dtype == torch.bfloat16 and torch.isfinite(logits).all()


def test_w4a8_says_why_a_file_keeps_its_old_requantising_path(tmp_path: Path, caplog,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "mixed.gguf"
    write_mixed_gguf(path, arch="qwen2")  # its second layer holds Q2_K (and Q5_1 and IQ4_XS, which w4a8 keeps)
    monkeypatch.delitem(A8_TYPE_FORMATS, "Q2_K")  # (a type without an int8-activation format)
    reader = open_gguf(path)
    assert a8_ready(file_types(reader), reader) == "no int8-activation format holds Q2_K"
    with caplog.at_level("WARNING"):
        model = load_model(str(path), "float32", "cpu", quantization="w4a8").model
    assert "requantises" in caplog.text and "Q2_K" in caplog.text
    assert not isinstance(model.model.layers[0].self_attn.qkv_proj, NativeA8Linear)

"""A GGUF file's own codes and scales, each tensor at its type, on the AMX-BF16 kernels.

The split of every type equals the ``gguf`` package's dequantisation; the kernels'
repack equals the torch reference bit for bit; a projection of the file's codes in a
folded format gives the products of its exact weights with the inputs rounded to
bfloat16 (within float32's summing error of float64), one in an 8-bit format the same
bfloat16 operands as ``amx-bf16`` on the dequantised weight (equal bits), and either
gives a row the same bits whatever rows are beside it; and a whole mixed-type model (a
Q4_K_M-like layer, then one of eight other types) loads that way, equal to the float
model made of the same weights.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from gguf_files import MIXED_TYPES, write_mixed_gguf
from models import ops
from models.gguf_linear import (F4, F4K, F8, F8_G16, F8_G16S, FALLBACK, FOLD_SWITCH, FOLDED, FOLDED_FORMATS,
                                SCALED_FORMATS, W4, W8, W8_AFFINE, W8_AFFINE_G16, W8_G16, NativeLinear,
                                QuantizedEmbedding, amx_format,
                                pack_amx, plan_segments, type_format, widen)
from models.gguf_native import empty_format, projection
from models.gguf_reader import GGUFTensor
from models.gguf_quants import SPLIT_TYPES, Codes, random_blocks, split
from models.loader import load_model
from models.quant import AmxBf16Linear, pack_amx_bf16

needs_amx_bf16 = pytest.mark.skipif(not ops.amx_bf16_usable(),
                                    reason="the GGUF codes run on AMX-BF16 tiles (tdpbf16ps has no exact twin)")

SHAPE = (48, 512)


def codes_of(type_name: str, shape: tuple[int, int] = SHAPE, seed: int = 1) -> tuple[np.ndarray, Codes]:
    raw = random_blocks(type_name, shape, seed, one_scale=True)  # as a real file's: offsets fold exactly
    return raw, split(type_name, raw, shape)


@pytest.mark.parametrize("type_name", SPLIT_TYPES)
def test_the_split_gives_the_values_the_gguf_package_dequantises(type_name: str) -> None:
    raw, codes = codes_of(type_name)
    want = quants.dequantize(raw, GGMLQuantizationType[type_name]).reshape(SHAPE)
    got = codes.dequantize().numpy()
    assert np.array_equal(got, want)  # every value, each rounded once as the reference rounds it
    u = codes.q + codes.offset  # the type's span
    assert 0 <= int(u.min()) and int(u.max()) < 2 ** codes.bits and -128 <= int(codes.q.min())
    assert codes.group in (16, 32) and codes.d.shape == (SHAPE[0], SHAPE[1] // codes.group)


@pytest.mark.parametrize("type_name", SPLIT_TYPES)
def test_an_embeddings_lookups_are_the_split_tables_rows_bit_for_bit(type_name: str) -> None:
    """The kernel's lookup (ops.gguf_rows) and torch's split of the picked rows both give the
    whole table's values, each bit (-0 too), for ids in any order, repeated."""
    raw = random_blocks(type_name, SHAPE, 5)  # (offsets that need not fold: every rounding shows)
    table = split(type_name, raw, SHAPE).dequantize()
    embedding = QuantizedEmbedding(type_name, raw, SHAPE, torch.float32)
    ids = torch.tensor([7, 0, SHAPE[0] - 1, 7, 30])
    for kernels in (True, False):
        ops.set_kernels_enabled(kernels)
        try:
            got = embedding(ids)
        finally:
            ops.set_kernels_enabled(True)
        assert torch.equal(got.view(torch.int32), table[ids].view(torch.int32)), kernels
    if ops.kernels_available():
        with pytest.raises(RuntimeError, match="out of range"):
            embedding(torch.tensor([SHAPE[0]]))


def test_a_split_of_the_wrong_size_is_refused() -> None:
    raw = random_blocks("Q4_K", (4, 256))
    with pytest.raises(ValueError, match="do not make a"):
        split("Q4_K", raw, (4, 512))
    with pytest.raises(ValueError, match="no integer split"):
        split("TQ1_0", raw, (4, 256))


@pytest.fixture(params=[False, True], ids=["scaled", "folded"])
def fold(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Each arithmetic a GGUF file's codes can load in (``KVSERVE_GGUF_FOLD``)."""
    monkeypatch.setenv(FOLD_SWITCH, "1" if request.param else "0")
    return request.param


def codes_format(type_name: str, fold: bool) -> int:
    """The format codes of ``type_name`` take (F4K, Q4_K's own, is made from a file's blocks only)."""
    fmt = (FOLDED_FORMATS if fold else SCALED_FORMATS)[type_name]
    return F4 if fmt == F4K else fmt


# Each type in each arithmetic's format, and in the 8-bit format it falls back to.
REPACKS = sorted({(t, f) for t in SPLIT_TYPES for fold in (False, True)
                  for f in (codes_format(t, fold), FALLBACK.get(codes_format(t, fold), codes_format(t, fold)))})


@pytest.mark.parametrize("type_name, fmt", REPACKS, ids=[f"{t}-{f}" for t, f in REPACKS])
def test_the_kernels_repack_the_blocks_as_the_torch_reference_packs_them(type_name: str, fmt: int) -> None:
    raw, codes = codes_of(type_name)
    order = torch.randperm(SHAPE[0], generator=torch.Generator().manual_seed(0))
    codes = replace(codes, q=codes.q[order], d=codes.d[order], m=None if codes.m is None else codes.m[order])
    want_codes, want_scales = pack_amx(codes, fmt)
    got_codes, got_scales = empty_format(fmt, SHAPE[0] // 16, SHAPE[1] // 32)
    exact = ops.repack_gguf(got_codes, got_scales, torch.from_numpy(raw), int(GGMLQuantizationType[type_name]),
                            fmt, order)
    assert exact
    assert torch.equal(got_codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(got_scales.view(torch.int32), want_scales.view(torch.int32))


def test_4_bit_formats_give_way_to_8_bit_codes_where_their_offsets_would_round(fold: bool) -> None:
    # W4 and F4 store M = m - 16 d: exact for every Q4_K tensor of the real files, not for any d and m.
    d = torch.tensor([[3.0e-5]] * 16)
    m = torch.tensor([[-1.0 - 2.0 ** -20]] * 16)
    codes = Codes(torch.randint(0, 16, (16, 32), dtype=torch.int16), d, m, 32, 4)
    assert amx_format(codes) == W8_AFFINE
    _, real = codes_of("Q4_K")
    assert amx_format(real) == (F4 if fold else W4) == codes_format("Q4_K", fold)


def test_codes_widen_to_formats_that_hold_them_and_only_those() -> None:
    _, q4k = codes_of("Q4_K")
    _, q6k = codes_of("Q6_K")
    _, q5_0 = codes_of("Q5_0")
    for codes, fmt in ((q4k, W8_AFFINE), (q4k, W8_AFFINE_G16), (q6k, W8_AFFINE_G16), (q4k, F8), (q4k, F8_G16),
                       (q5_0, F8), (q6k, F8_G16), (q6k, F8_G16S)):
        wide = widen(codes, fmt)  # the same values, in the wider format's shape of scales
        assert wide.d.shape[1] == SHAPE[1] // (16 if fmt in (W8_AFFINE_G16, F8_G16, F8_G16S) else 32)
        assert (wide.bits, wide.offset) == ((7, 0) if fmt in FOLDED else (8, 128))
        assert torch.equal(wide.dequantize(), codes.dequantize())
    with pytest.raises(ValueError, match="cannot hold scales per 16 inputs"):
        pack_amx(q6k, W8)  # Q6_K's 16-input scales in a format with one scale per 32
    with pytest.raises(ValueError, match="no offset"):
        pack_amx(q4k, W8_G16)  # Q4_K's minimums in a format without offsets
    with pytest.raises(ValueError, match="at most 7 bits"):
        pack_amx(codes_of("Q8_0")[1], F8)


@needs_amx_bf16
def test_a_4_bit_tensor_whose_offsets_would_round_takes_8_bit_codes(fold: bool) -> None:
    raw = random_blocks("Q4_K", SHAPE, seed=4).reshape(SHAPE[0], -1, 144).copy()
    raw[..., 0:2] = np.array([0.05], dtype=np.float16).view(np.uint8)  # d: scales up to about 3
    raw[..., 2:4] = np.array([3e-6], dtype=np.float16).view(np.uint8)  # dmin: minimums far below them
    raw = raw.reshape(SHAPE[0], -1)
    fmt = type_format("Q4_K")
    codes_t, scales_t = empty_format(fmt, SHAPE[0] // 16, SHAPE[1] // 32)
    source = torch.arange(SHAPE[0])
    assert not ops.repack_gguf(codes_t, scales_t, torch.from_numpy(raw), int(GGMLQuantizationType.Q4_K), fmt, source)
    tensor = GGUFTensor("q", int(GGMLQuantizationType.Q4_K), (SHAPE[1], SHAPE[0]), raw)
    linear = projection(None, [tensor], [None])
    assert linear.formats == [W8_AFFINE]
    x = torch.randn(5, SHAPE[1], generator=torch.Generator().manual_seed(6))
    assert torch.equal(linear(x), bf16_reference(x, split("Q4_K", raw, SHAPE).dequantize()))


def test_parts_share_a_segment_when_their_format_or_their_tile_does() -> None:
    assert plan_segments([F4, F4, F8_G16], [64, 16, 16]) == [(F4, [0, 1]), (F8_G16, [2])]
    assert plan_segments([F4, F8_G16, W8], [32, 16, 16]) == [(F4, [0]), (F8_G16, [1]), (W8, [2])]
    # a boundary inside a tile: one segment, in the format that holds both
    assert plan_segments([F4, F8_G16], [40, 24]) == [(F8_G16, [0, 1])]
    assert plan_segments([F4, F8], [40, 24]) == [(F8, [0, 1])]
    assert plan_segments([F4, W8], [40, 24]) == [(W8_AFFINE, [0, 1])]
    assert plan_segments([W8, W8_AFFINE], [8, 8]) == [(W8_AFFINE, [0, 1])]
    assert plan_segments([W4, W4, W8_G16], [64, 16, 16]) == [(W4, [0, 1]), (W8_G16, [2])]
    assert plan_segments([W4, W8_G16], [40, 24]) == [(W8_AFFINE_G16, [0, 1])]


def bf16_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The same tile products on the dequantised weight rounded to bfloat16."""
    return ops.amx_bf16_linear(x, pack_amx_bf16(weight), weight.shape[0])


def folded_reference(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact weight times x rounded to bfloat16, in float64, and a bound on float32's
    summing error for each output (the sums of |x w| times 2^-20: a few dozen roundings)."""
    xb, w = x.bfloat16().double(), weight.double()
    return xb @ w.T, (xb.abs() @ w.abs().T) * 2.0 ** -20


def assert_segments_match(linear: NativeLinear, x: torch.Tensor, weight: torch.Tensor) -> None:
    """Each segment of ``linear`` as its format computes: a folded one within float32's summing
    error of the exact products, an 8-bit one equal to amx-bf16 on its dequantised rows."""
    y, row = linear(x), 0
    for i, fmt in enumerate(linear.formats):
        rows = min(linear.fused_args[2 * i].shape[0] * 16, weight.shape[0] - row)
        got, w = y[:, row:row + rows], weight[row:row + rows]
        if fmt in FOLDED:
            want, bound = folded_reference(x, w)
            assert ((got.double() - want).abs() <= bound).all(), f"format {fmt}"
        else:
            assert torch.equal(got, bf16_reference(x, w)), f"format {fmt}"
        row += rows
    assert row == weight.shape[0]
    for rows in (1, 5, 16, 17, 33):  # a row's result does not depend on the rows beside it
        assert torch.equal(linear(x[:rows]), y[:rows])


@needs_amx_bf16
@pytest.mark.parametrize("type_name", SPLIT_TYPES)
def test_a_projection_multiplies_the_files_values(type_name: str, fold: bool) -> None:
    _, codes = codes_of(type_name)
    linear = NativeLinear.from_codes([codes])
    assert linear.formats == [codes_format(type_name, fold)]
    x = torch.randn(40, SHAPE[1], generator=torch.Generator().manual_seed(2))
    assert_segments_match(linear, x, codes.dequantize())


@needs_amx_bf16
def test_a_projection_of_parts_in_different_types_keeps_each_type(fold: bool) -> None:
    x = torch.randn(40, SHAPE[1], generator=torch.Generator().manual_seed(3))
    parts = [codes_of("Q4_K", (32, 512))[1], codes_of("Q6_K", (16, 512), 2)[1], codes_of("Q8_0", (16, 512), 3)[1]]
    linear = NativeLinear.from_codes(parts)
    assert linear.formats == ([F4, F8_G16S, W8] if fold else [W4, W8_G16, W8])
    assert_segments_match(linear, x, torch.cat([p.dequantize() for p in parts]))
    unaligned = [codes_of("Q4_K", (40, 512))[1], codes_of("Q6_K", (24, 512), 2)[1]]
    linear = NativeLinear.from_codes(unaligned)
    assert linear.formats == [F8_G16 if fold else W8_AFFINE_G16]
    assert_segments_match(linear, x, torch.cat([p.dequantize() for p in unaligned]))


# --- whole models ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mixed_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.nn.Module]]:
    root = tmp_path_factory.mktemp("mixed")
    return {arch: (root / f"{arch}.gguf", write_mixed_gguf(root / f"{arch}.gguf", arch=arch))
            for arch in ("qwen2", "llama")}


PROMPT = torch.randint(256, (37,), generator=torch.Generator().manual_seed(5)).tolist()


def logits_of(model: torch.nn.Module, make_runner) -> torch.Tensor:
    runner = make_runner(model)
    return runner.step([(runner.new_seq(len(PROMPT)), PROMPT)])[0]


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_the_exact_path_equals_transformers_on_a_file_of_many_types(mixed_files, make_runner, arch: str) -> None:
    path, reference = mixed_files[arch]
    ours = logits_of(load_model(str(path), "float32", "cpu", quantization="none").model, make_runner)
    # transformers in float64: its float32 run is 2.5e-4 from it at these widths, ours 4e-5.
    with torch.no_grad():
        want = copy.deepcopy(reference).double()(torch.tensor([PROMPT])).logits[0]
    diff = (ours.double() - want).abs().max().item()
    assert diff < 1e-4, f"max |logit diff| from transformers (float64) {diff:.2e}; kernels on: {ops.kernels_enabled(torch.device('cpu'))}"


@needs_amx_bf16
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_w4a16_keeps_each_tensor_at_its_type(mixed_files, make_runner, arch: str, fold: bool) -> None:
    path, _ = mixed_files[arch]
    native = load_model(str(path), "float32", "cpu", quantization="w4a16").model
    layers = native.model.layers
    assert [p.kind for layer in layers for p in (layer.self_attn.qkv_proj, layer.mlp.down_proj)] == ["native"] * 4
    # Q4_K q and k, then a Q6_K v; a Q5_K q, a Q8_0 k and a Q5_0 v (8-bit codes with a scale per
    # 32, scaled: sharing one segment)
    assert [MIXED_TYPES[1][k] for k in ("attn_q", "attn_k", "attn_v")] == ["Q5_K", "Q8_0", "Q5_0"]
    want_formats = ([[F4K, F8_G16S], [F8_G16S], [F8, W8, F8]] if fold
                    else [[W4, W8_G16], [W8_G16], [W8_AFFINE, W8]])
    assert [layers[0].self_attn.qkv_proj.formats, layers[0].mlp.down_proj.formats,
            layers[1].self_attn.qkv_proj.formats] == want_formats
    assert all(layer.packed_int4() for layer in layers)  # the fused layer runs them
    exact = load_model(str(path), "float32", "cpu", quantization="none").model
    want = logits_of(exact, make_runner)
    for layer in exact.model.layers:
        for block, name in (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"),
                            ("mlp", "down_proj")):
            module = getattr(layer, block)
            setattr(module, name, AmxBf16Linear(_linear(getattr(module, name)), "amx-bf16"))
    exact.lm_head = AmxBf16Linear(_linear(exact.lm_head), "amx-bf16")
    ours, bf16 = logits_of(native, make_runner), logits_of(exact, make_runner)
    if not fold:
        # The same bfloat16 operands as amx-bf16 on the dequantised weights, head included: equal bits.
        assert torch.equal(ours, bf16)
        return
    # Folded, each projection is held to its formats' arithmetic above (assert_segments_match);
    # here the whole model: its rounding beyond the exact path's is the inputs' to bfloat16 (and
    # Q8_0's weights'), which amx-bf16 also has (with every weight rounded too). Through the
    # layers the inputs' roundings dominate both, so the bound is amx-bf16's distance, not a
    # fraction of it (measured: native 0.077 / 0.301, amx-bf16 0.102 / 0.299, qwen2 / llama).
    ours, bf16 = (ours - want).abs().max().item(), (bf16 - want).abs().max().item()
    assert ours < 1.25 * bf16, f"max |logit diff| from the exact path: native {ours:.2e}, amx-bf16 {bf16:.2e}"


def _linear(packed: torch.nn.Module) -> torch.nn.Linear:
    """A float ``nn.Linear`` of a packed projection's weight."""
    linear = torch.nn.Linear(packed.in_features, packed.out_features, bias=packed.bias is not None)
    with torch.no_grad():
        linear.weight.copy_(packed.weight)
        if packed.bias is not None:
            linear.bias.copy_(packed.bias)
    return linear


@needs_amx_bf16
def test_symmetric_codes_fold_the_same_from_d_alone() -> None:
    # F8_G16S stores D alone and takes M = -1.5 D: the same M as F8_G16 stores, so equal bits.
    _, codes = codes_of("Q6_K")
    x = torch.randn(20, SHAPE[1], generator=torch.Generator().manual_seed(7))
    both = [ops.amx_quant_linear(x, list(pack_amx(codes, fmt)), [fmt], SHAPE[0]) for fmt in (F8_G16, F8_G16S)]
    assert torch.equal(both[0], both[1])
    assert pack_amx(codes, F8_G16S)[1].numel() * 2 == pack_amx(codes, F8_G16)[1].numel()


@needs_amx_bf16
def test_q4_k_folds_from_its_own_scales_as_from_d_and_m(monkeypatch: pytest.MonkeyPatch) -> None:
    # F4K keeps Q4_K's 6-bit scales and minimums per 256 inputs and makes F4's D and M from
    # them: equal bits, with 0.37x the scale bytes.
    monkeypatch.setenv(FOLD_SWITCH, "1")
    raw, codes = codes_of("Q4_K")
    tensor = GGUFTensor("q", int(GGMLQuantizationType.Q4_K), (SHAPE[1], SHAPE[0]), raw)
    order = torch.randperm(SHAPE[0], generator=torch.Generator().manual_seed(8))
    from_file = projection(None, [tensor], [order])
    from_codes = NativeLinear.from_codes([replace(codes, q=codes.q[order], d=codes.d[order], m=codes.m[order])])
    assert (from_file.formats, from_codes.formats) == ([F4K], [F4])
    x = torch.randn(40, SHAPE[1], generator=torch.Generator().manual_seed(9))
    assert torch.equal(from_file(x), from_codes(x))
    for rows in (1, 16, 17):
        assert torch.equal(from_file(x[:rows]), from_codes(x[:rows]))
    scale_bytes = [t.numel() * t.element_size() for t in (from_file.fused_args[1], from_codes.fused_args[1])]
    assert scale_bytes[0] * 8 == scale_bytes[1] * 3
    with pytest.raises(ValueError, match="made from a file"):
        pack_amx(codes, F4K)


def test_the_fold_switch_takes_0_or_1(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FOLD_SWITCH, "yes")
    with pytest.raises(ValueError, match="expected 0 or 1"):
        type_format("Q4_K")
    monkeypatch.delenv(FOLD_SWITCH)
    assert type_format("Q4_K") == W4 and type_format("Q6_K") == W8_G16  # scaled by default

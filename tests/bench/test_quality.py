"""bench.quality's arithmetic and parsing (the real run loads every path; `python -m bench.quality`)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from bench import quality

CTX = 8


def test_windows_are_whole_and_back_to_back():
    assert quality.windows(list(range(20)), CTX) == [list(range(8)), list(range(8, 16))]


def test_the_text_is_long_enough():
    words = quality.TEXT.read_text().split()
    assert len(words) > 3000  # at least 4k tokens for any BPE vocabulary of this size


def fake_paths(monkeypatch, logits_by_path):
    def fake(path, chunks, ctx, model):
        for _ in chunks:
            yield torch.log_softmax(logits_by_path[path], dim=-1)
    monkeypatch.setattr(quality, "path_logprobs", fake)


def test_measure_compares_each_path_with_the_first(monkeypatch):
    ref, same, other = ("float32", "none", "float32"), ("a", "b", "c"), ("x", "y", "z")
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(CTX // 2 - 1, 10, generator=gen)
    flipped = base.clone()
    flipped[0] = -flipped[0]  # one position's top token changes
    fake_paths(monkeypatch, {ref: base, same: base, other: flipped})
    chunks = [list(range(CTX)), list(range(CTX))]

    rows = quality.measure(chunks, CTX, [ref, same, other])

    assert [r.tokens for r in rows] == [2 * (CTX // 2 - 1)] * 3
    assert rows[0].mean_kld is None
    assert rows[1].mean_kld == 0 and rows[1].same_top == 1
    assert rows[2].mean_kld > 0 and rows[2].p99_kld >= rows[2].mean_kld
    assert rows[2].same_top == pytest.approx(1 - 2 / rows[2].tokens)
    # Perplexity: exp of the mean NLL of each window's next tokens (positions ctx/2 + 1 ..).
    logp = torch.log_softmax(base, dim=-1)
    targets = torch.tensor(chunks[0][CTX // 2 + 1:])
    nll = -logp.gather(1, targets[:, None]).mean().item()
    assert rows[0].perplexity == pytest.approx(math.exp(nll), rel=1e-6)


def test_llama_perplexity_figures_are_read_from_its_output():
    out = ("kl_divergence: computing over 11 chunks, n_ctx=512, batch_size=512, n_seq=1\n"
           "Mean PPL(Q)                   :  17.123456 ±   0.400000\n"
           "Mean    KLD:   0.051234 ±   0.001000\n"
           "99.0%   KLD:   0.401000\n"
           "Same top p: 91.234 ± 0.500 %\n")
    assert quality._number(r"over (\d+) chunks", out) == 11
    assert quality._number(r"Mean PPL\(Q\)\s*:\s*([0-9.]+)", out) == 17.123456
    assert quality._number(r"Mean\s+KLD:\s*([0-9.]+)", out) == 0.051234
    assert quality._number(r"99\.0%\s+KLD:\s*([0-9.]+)", out) == 0.401
    assert quality._number(r"Same top p:\s*([0-9.]+)", out) == 91.234
    with pytest.raises(RuntimeError, match="printed no"):
        quality._number(r"Final estimate: PPL = ([0-9.]+)", out)


DEFAULT = ("float32", "w4a16", "float16")


def test_paths_start_with_the_exact_reference_and_list_each_once():
    assert quality.select_paths(["default"], DEFAULT) == [quality.REFERENCE, DEFAULT]
    assert quality.select_paths(["float32/none/float32", "default", "default"], DEFAULT) == \
        [quality.REFERENCE, DEFAULT]
    assert quality.select_paths(["bfloat16/int4/bfloat16"], DEFAULT, spans=[32]) == \
        [quality.REFERENCE, ("bfloat16", "int4", "bfloat16"), ("float32", "w4a8", "float16", 32)]


def test_all_paths_are_every_path_and_the_amx_ones_where_the_cpu_runs_them():
    assert quality.select_paths(["all"], DEFAULT) == quality.PATHS
    assert quality.select_paths(["all", "default"], DEFAULT, amx_bf16=True) == \
        quality.PATHS + quality.AMX_BF16_PATHS


@pytest.mark.parametrize("spec", ["float32/w4a8", "float64/none/float32", "float32/none/float8", "exact"])
def test_a_path_that_is_not_dtype_quantization_kv_is_refused(spec):
    with pytest.raises(ValueError, match="DTYPE/QUANTIZATION/KV"):
        quality.select_paths([spec], DEFAULT)


def test_the_defaults_are_the_default_model_every_path_and_every_window():
    args = quality.build_parser().parse_args([])
    assert (args.model, args.paths, args.max_windows) == ("smollm2", ["all"], None)
    args = quality.build_parser().parse_args(["--model", "qwen2.5-coder-1.5b", "--paths", "default",
                                              "--max-windows", "3"])
    assert (args.model, args.paths, args.max_windows) == ("qwen2.5-coder-1.5b", ["default"], 3)


@pytest.mark.parametrize("argv, message", [
    (["--max-windows", "0"], "at least 1"),
    (["--model", "/no/such/model.gguf"], "neither a known name"),
])
def test_bad_arguments_stop_before_any_model_is_loaded(argv, message, capsys):
    with pytest.raises(SystemExit):
        quality.main(argv)
    assert message in capsys.readouterr().err


def test_llama_cpp_scores_the_given_file_over_at_most_max_windows(monkeypatch, tmp_path):
    calls = []
    out = ("perplexity: calculating perplexity over 3 chunks, n_ctx=512\nFinal estimate: PPL = 9.5\n"
           "Mean PPL(Q) : 10.25\nMean    KLD:   0.0125\n99.0%   KLD:   0.125\nSame top p: 95.5 %\n")

    def run(argv, **kwargs):
        calls.append(argv)
        return quality.subprocess.CompletedProcess(argv, 0, out, "")

    monkeypatch.setattr(quality.llama_cpp, "ensure_built",
                        lambda cache: {"llama-quantize": Path("quantize"), "llama-perplexity": Path("perplexity")})
    monkeypatch.setattr(quality.subprocess, "run", run)
    gguf = tmp_path / "model-q4_k_m.gguf"

    rows = quality.llama_cpp_quality(512, 2, gguf, max_windows=3, cache=tmp_path)

    assert calls[0] == ["quantize", "--allow-requantize", str(gguf), str(tmp_path / "model-q4_k_m-f32.gguf"), "F32"]
    assert calls[1][:3] == ["perplexity", "-m", str(tmp_path / "model-q4_k_m-f32.gguf")]
    assert calls[2][:3] == ["perplexity", "-m", str(gguf)]
    assert all(c[c.index("--chunks") + 1] == "3" for c in calls[1:])
    assert [r.tokens for r in rows] == [3 * 255] * 2
    assert (rows[1].perplexity, rows[1].mean_kld, rows[1].p99_kld, rows[1].same_top) == (10.25, 0.0125, 0.125, 0.955)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_coarse_activations_at_16_inputs_compute_what_the_kernel_computes(kind):
    from models import ops
    from models.quant import QuantizedLinear

    if not ops.has_int8_dots():
        pytest.skip("w4a8 needs kvserve's int8 kernels (AVX2 or AVX-512)")
    gen = torch.Generator().manual_seed(0)
    dense = torch.nn.Linear(96, 40, bias=False)
    dense.weight.data = torch.randn(40, 96, generator=gen) * 0.1
    layer = QuantizedLinear(dense, kind, int8_activations=True)
    assert layer.int8_activations
    x = torch.randn(7, 96, generator=gen)
    kernel = layer(x)
    scale = kernel.abs().max().item()
    at16 = quality.CoarseActivations(layer, 16)(x)
    # The same roundings; only the order of the float sums differs.
    assert (at16 - kernel).abs().max().item() < 1e-5 * scale
    # A coarser scale rounds x more coarsely: farther from the float product.
    exact = x @ layer_weight(layer).T
    errors = [(quality.CoarseActivations(layer, span)(x) - exact).abs().mean().item() for span in (16, 32, 0)]
    assert errors[0] < errors[1] < errors[2]


def layer_weight(layer) -> torch.Tensor:
    """The quantised weight [N, K] that a QuantizedLinear multiplies by (codes and scales decoded)."""
    q = quality.CoarseActivations(layer, 16)
    return (q.centred + q.offset.repeat_interleave(32, dim=1))[:layer.out_features].float()


def test_coarsen_activations_swaps_the_int8_projections_of_a_model():
    from models import ops
    from models.quant import QuantizedLinear

    if not ops.has_int8_dots():
        pytest.skip("w4a8 needs kvserve's int8 kernels (AVX2 or AVX-512)")
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 16))
    model[0] = QuantizedLinear(model[0], "int4", int8_activations=True)
    model[1] = QuantizedLinear(model[1], "int4")  # float activations: left alone
    quality.coarsen_activations(model, 32)
    assert isinstance(model[0], quality.CoarseActivations) and model[0].span == 32
    assert isinstance(model[1], QuantizedLinear)
    assert quality.path_name(("float32", "w4a8", "float16", 32)) == \
        "float32 + w4a8, float16 KV cache, activations rounded per 32 inputs (emulated)"
    assert quality.path_name(("float32", "w4a8", "float16", 0)).endswith("rounded per row (emulated)")

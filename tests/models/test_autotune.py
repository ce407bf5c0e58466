"""models.autotune: the candidates a CPU can run, the measured choice, and its cache."""

from __future__ import annotations

import dataclasses

import logging
from pathlib import Path

import pytest
import torch

from models import autotune, ops
from models.ops import cli
from models.autotune import RunPath, Timing
from models.config import ModelConfig
from models.loader import resolve_path

# Shapes the kernels accept (multiples of 32), small enough to time in milliseconds.
TINY = ModelConfig(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64,
                   intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, max_position_embeddings=2048)
VNNI = ops.kernels_available() and ops.has_int8_dots()
FOUR_BIT_QUANTS = (["w4a8"] if VNNI else []) + ["int4", "none"]
DTYPES = ["float32"] + (["bfloat16"] if autotune.cpu_has_native_bf16() else [])


def paths(dtypes: list[str], quants: list[str]) -> list[RunPath]:
    """What ``candidates`` lists for a 4-bit checkpoint: each pair, then w4a8 on AMX where
    the GEMMs can use it, then w4a16 where AMX-BF16 is."""
    plain = [RunPath(d, q) for d in dtypes for q in quants]
    amx = [RunPath(p.dtype, p.quantization, amx=True) for p in plain if p.quantization == "w4a8"]
    w4a16 = [RunPath("float32", "w4a16")] if "float32" in dtypes else []
    return plain + (amx if ops.amx_usable() else []) + (w4a16 if ops.amx_bf16_usable() else [])


def test_settings_that_are_not_auto_are_kept() -> None:
    assert autotune.candidates("bfloat16", "int4", four_bit=True) == [RunPath("bfloat16", "int4")]
    assert autotune.candidates("float32", "auto", four_bit=False) == [RunPath("float32", "none")]


def test_open_settings_list_every_path_this_cpu_runs() -> None:
    assert autotune.candidates("auto", "auto", four_bit=True) == paths(DTYPES, FOUR_BIT_QUANTS)
    assert autotune.candidates("float32", "auto", four_bit=True) == paths(["float32"], FOUR_BIT_QUANTS)


def test_w4a16_is_a_candidate_only_where_amx_bf16_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_AMX", "auto")
    monkeypatch.setattr(autotune.ops, "amx_bf16_usable", lambda: True)
    assert RunPath("float32", "w4a16") in autotune.candidates("float32", "auto", True)
    # Not for a checkpoint without 4-bit projections, nor with bfloat16 activations.
    assert autotune.candidates("float32", "auto", False) == [RunPath("float32", "none")]
    assert all(p.quantization != "w4a16" for p in autotune.candidates("bfloat16", "auto", True))
    # KVSERVE_AMX=force times w4a8 on AMX-INT8 against the rest, not against w4a16.
    monkeypatch.setenv("KVSERVE_AMX", "force")
    assert all(p.quantization != "w4a16" for p in autotune.candidates("float32", "auto", True))
    monkeypatch.setenv("KVSERVE_AMX", "auto")
    monkeypatch.setattr(autotune.ops, "amx_bf16_usable", lambda: False)
    assert all(p.quantization != "w4a16" for p in autotune.candidates("float32", "auto", True))


def test_w4a8_keeping_a_files_types_is_the_float32_path_and_no_float_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_AMX", "auto")
    monkeypatch.setattr(autotune.ops, "amx_bf16_usable", lambda: False)
    # A Q4_K_M file: not "4-bit" (its Q6_K tensors), but every type has an int8-activation format:
    # it runs at its own bits, never as a float copy of every projection (none), so nothing to time.
    assert autotune.candidates("auto", "auto", False, native=True, native_a8=True) == [RunPath("float32", "w4a8")]
    assert autotune.candidates("float32", "none", False, native=True, native_a8=True) == [RunPath("float32", "none")]
    assert autotune.candidates("float32", "auto", False, native=True) == [RunPath("float32", "none")]
    monkeypatch.setattr(autotune.ops, "amx_bf16_usable", lambda: True)  # (an AMX CPU times w4a16 beside it)
    assert autotune.candidates("auto", "auto", False, native=True, native_a8=True) == [
        RunPath("float32", "w4a8"), RunPath("float32", "w4a16")]


def test_without_the_kernels_w4a8_is_no_candidate() -> None:
    ops.set_kernels_enabled(False)
    try:
        assert autotune.candidates("float32", "auto", True) == paths(["float32"], ["int4", "none"])
    finally:
        ops.set_kernels_enabled(True)


def test_the_pick_weighs_decode_full_batch_and_prompt_alike() -> None:
    fast_decode = Timing(RunPath("float32", "w4a8"), decode_ms=10.0, prompt_ms=300.0, full_batch_ms=40.0)
    fast_prompt = Timing(RunPath("bfloat16", "none"), decode_ms=20.0, prompt_ms=200.0, full_batch_ms=40.0)
    balanced = Timing(RunPath("float32", "int4"), decode_ms=12.0, prompt_ms=220.0, full_batch_ms=40.0)
    best, why = autotune.pick([fast_decode, fast_prompt, balanced])
    assert best is balanced  # 1.2 x 1.1 beats 1.0 x 1.5 and 2.0 x 1.0
    assert why.index("float32 + int4") < why.index("float32 + w4a8") < why.index("bfloat16 + none")
    # A path slow with a full batch loses to one a little slower with a few sequences:
    # 1.1 x 1.0 x 1.0 beats 1.0 x 2.2 x 1.0 (w4a8 on AMX-INT8 against w4a16, measured).
    few = Timing(RunPath("float32", "w4a8", amx=True), decode_ms=20.0, prompt_ms=100.0, full_batch_ms=100.0)
    full = Timing(RunPath("float32", "w4a16"), decode_ms=22.0, prompt_ms=100.0, full_batch_ms=45.0)
    best, why = autotune.pick([few, full])
    assert best is full and "of 64 45.0 ms" in why


def test_the_choice_is_measured_once_then_read_from_the_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    measured: list[RunPath] = []

    def fake_measure(config: ModelConfig, path: RunPath) -> Timing:
        measured.append(path)
        fast = path == RunPath("float32", "int4")
        return Timing(path, decode_ms=1.0 if fast else 2.0, prompt_ms=5.0 if fast else 6.0, full_batch_ms=3.0)

    monkeypatch.setattr(autotune, "measure_all", lambda config, paths, **_: [fake_measure(config, p) for p in paths])
    with caplog.at_level(logging.INFO, logger="models.autotune"):
        first = autotune.choose(TINY, "float32", "auto", four_bit=True, cache_dir=tmp_path)
        assert measured == paths(["float32"], FOUR_BIT_QUANTS)
        again = autotune.choose(TINY, "float32", "auto", four_bit=True, cache_dir=tmp_path)
    assert first == again == RunPath("float32", "int4")
    n = len(paths(["float32"], FOUR_BIT_QUANTS))
    assert len(measured) == n, "the second choice came from the cache"
    assert "path auto: float32 + int4" in caplog.text and "measured earlier" in caplog.text
    # Another model (or another set of candidates) is measured anew.
    autotune.choose(TINY, "float32", "auto", four_bit=False, cache_dir=tmp_path)
    autotune.choose(ModelConfig(**{**TINY.__dict__, "hidden_size": 128}), "float32", "auto",
                    four_bit=True, cache_dir=tmp_path)
    assert len(measured) == 2 * n  # four_bit=False had one candidate: no timing


def test_measuring_again_replaces_the_cached_choice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A choice made while the machine was busy stays until measured again.
    fastest = {"quantization": "int4"}
    monkeypatch.setattr(autotune, "measure_all", lambda config, paths, **_: [Timing(
        p, decode_ms=1.0 if p.quantization == fastest["quantization"] else 2.0, prompt_ms=1.0, full_batch_ms=1.0)
        for p in paths])
    assert autotune.choose(TINY, "float32", "auto", four_bit=True, cache_dir=tmp_path).quantization == "int4"
    fastest["quantization"] = "none"
    assert autotune.choose(TINY, "float32", "auto", four_bit=True, cache_dir=tmp_path).quantization == "int4"
    again = autotune.choose(TINY, "float32", "auto", four_bit=True, cache_dir=tmp_path, measure_again=True)
    assert again.quantization == "none"
    assert autotune.choose(TINY, "float32", "auto", four_bit=True, cache_dir=tmp_path) == again  # the new one kept


@pytest.mark.parametrize("path", paths(DTYPES, FOUR_BIT_QUANTS), ids=str)
def test_every_candidate_runs_on_a_probe_model(path: RunPath) -> None:
    t = autotune.measure(TINY, path, runs=1)
    assert t.path == path and t.decode_ms > 0 and t.prompt_ms > 0 and t.full_batch_ms > 0


def test_a_probe_of_a_windowed_model_keeps_its_first_layers_windows() -> None:
    # Gemma 3's 18 layers, windowed but every sixth: the probe's 4 layers are its first four.
    gemma = dataclasses.replace(TINY, architecture="Gemma3ForCausalLM", num_hidden_layers=18, qk_norm=True,
                                layer_windows=tuple(0 if (i + 1) % 6 == 0 else 64 for i in range(18)))
    probe = autotune._Probe(gemma, RunPath("float32", "none"))
    assert [layer.self_attn.window for layer in probe.model.model.layers] == [64] * probe.layers
    assert autotune.measure(gemma, RunPath("float32", "none"), runs=1).decode_ms > 0


def test_the_candidates_are_timed_in_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    # A burst of another process must fall on every candidate alike: each round times
    # every path once, after one unrecorded warm-up call of each.
    calls: list[tuple[str, bool]] = []
    monkeypatch.setattr(autotune._Probe, "run", lambda self, record: calls.append((str(self.path), record)))
    monkeypatch.setattr(autotune._Probe, "timing", lambda self: Timing(self.path, 1.0, 1.0, 1.0))
    options = paths(DTYPES, FOUR_BIT_QUANTS)
    timings = autotune.measure_all(TINY, options, runs=3)
    assert [t.path for t in timings] == options
    names = [str(p) for p in options]
    assert calls == [(n, False) for n in names] + [(n, True) for n in names] * 3


def test_probes_of_one_kv_dtype_share_a_cache() -> None:
    # Nine candidates' probes are alive at once: one KV cache per dtype, not one each.
    caches: dict = {}
    a = autotune._Probe(TINY, RunPath("float32", "none"), caches)
    b = autotune._Probe(TINY, RunPath("float32", "int4"), caches)
    c = autotune._Probe(TINY, RunPath("bfloat16", "none"), caches)
    assert a.caches is b.caches and a.caches is not c.caches and len(caches) == 2


def test_the_fastest_of_the_rounds_makes_the_timing() -> None:
    # A disturbance only adds time: however many rounds it slowed, one that it did not is the path's time.
    probe = autotune._Probe(TINY, RunPath("float32", "none"))
    probe.times = {"decode": [9.0, 8.0, 2.0], "prompt": [50.0, 5.0, 60.0], "full_batch": [7.0, 4.0, 8.0],
                   "head_decode": [0.5, 0.6, 0.5], "head_prompt": [1.0, 1.0, 1.5],
                   "head_full_batch": [2.0, 1.0, 1.0]}
    t = probe.timing()
    layers = TINY.num_hidden_layers / probe.layers
    assert t.decode_ms == pytest.approx(0.5 + 1.5 * layers) and t.prompt_ms == pytest.approx(1.0 + 4.0 * layers)
    assert t.full_batch_ms == pytest.approx(1.0 + 3.0 * layers)


def test_resolve_path_keeps_forced_settings_and_measures_open_ones(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(autotune.ops, "cache_directory", lambda: tmp_path)
    cpu = torch.device("cpu")
    assert resolve_path("float32", "none", TINY, "Q4_1", cpu) == (torch.float32, "none")
    assert resolve_path("bfloat16", "w4a8", TINY, None, cpu) == (torch.bfloat16, "w4a8")
    # An HF directory (no GGUF type) with a forced dtype has one candidate: no timing.
    assert resolve_path("float32", "auto", TINY, None, cpu) == (torch.float32, "none")
    dtype, quant = resolve_path("float32", "auto", TINY, "Q4_1", cpu)
    assert dtype == torch.float32 and quant in FOUR_BIT_QUANTS + (["w4a16"] if ops.amx_bf16_usable() else [])
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_path("float8", "none", TINY, None, cpu)


def test_an_moe_file_keeps_its_experts_codes_on_w4a8_or_w4a16(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # The path probes are dense layers, and every other path makes each expert float first.
    monkeypatch.setattr(autotune.ops, "cache_directory", lambda: tmp_path)
    cpu = torch.device("cpu")
    for amx in (True, False):
        monkeypatch.setattr(ops, "amx_bf16_usable", lambda amx=amx: amx)
        got = resolve_path("float32", "auto", TINY, None, cpu, moe_native=True)
        assert got == (torch.float32, "w4a16" if amx else "none")
    # w4a8 where its formats hold every projection's type, on any CPU with integer dots.
    for amx in (True, False):
        monkeypatch.setattr(ops, "amx_bf16_usable", lambda amx=amx: amx)
        got = resolve_path("float32", "auto", TINY, None, cpu, moe_native=True, moe_a8=True)
        assert got == (torch.float32, "w4a8")
    # A setting given is kept, and a file whose experts w4a16 cannot keep is measured as before.
    monkeypatch.setattr(ops, "amx_bf16_usable", lambda: True)
    assert resolve_path("float32", "none", TINY, None, cpu, moe_native=True) == (torch.float32, "none")
    assert resolve_path("float32", "auto", TINY, None, cpu, moe_native=False) == (torch.float32, "none")


def test_on_cuda_auto_is_bfloat16_without_quantization(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    cuda = torch.device("cuda")
    assert resolve_path("auto", "auto", TINY, "Q4_1", cuda) == (torch.bfloat16, "none")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert resolve_path("auto", "auto", TINY, None, cuda) == (torch.float16, "none")


def test_python_m_models_ops_reports_the_choice(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from models import loader

    monkeypatch.setattr(loader, "read_config", lambda name: (TINY, "Q4_1", None))
    monkeypatch.setattr(autotune.ops, "cache_directory", lambda: tmp_path)
    monkeypatch.setattr(autotune, "measure_all", lambda config, paths, **_: [Timing(
        path, decode_ms=1.0 if path.quantization == "int4" else 3.0, prompt_ms=1.0, full_batch_ms=1.0)
        for path in paths])
    assert cli.main(["--choose-path", "tiny"]) == 0
    measured = []
    monkeypatch.setattr(autotune, "choose", lambda *a, measure_again, **k: measured.append(measure_again) or
                        RunPath(DTYPES[0], "int4"))
    assert cli.main(["--choose-path", "tiny", "--measure-again"]) == 0
    assert measured == [True]
    with pytest.raises(SystemExit):
        cli.main(["--measure-again"])
    out = capsys.readouterr().out
    assert "fused CPU kernels: ready" in out
    assert f"int8 dots: {ops.int8_dots() or 'none'}; AMX-INT8: " in out
    assert ("AMX-INT8: usable" in out) == ops.amx_usable()
    assert f"path auto for tiny: {DTYPES[0]} + int4" in out


@pytest.fixture
def emulated_amx():
    """AMX usable on software tiles (the AMX kernel's code, its tile instructions emulated)."""
    if not ops.set_amx_emulated(True):
        pytest.skip("emulating AMX needs a CPU with AVX512-VNNI and the kernels built")
    try:
        assert ops.amx_usable()
        yield
    finally:
        ops.set_amx_enabled(False)
        ops.set_amx_emulated(False)


def test_kvserve_amx_force_runs_w4a8_on_amx_whatever_the_timing(
        emulated_amx, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(autotune.ops, "cache_directory", lambda: tmp_path)
    monkeypatch.setenv("KVSERVE_AMX", "force")
    # Forced settings keep AMX (without the switch they ran on VNNI, untimed).
    assert autotune.candidates("float32", "w4a8", True) == [RunPath("float32", "w4a8", amx=True)]
    # Open ones time w4a8 on AMX only, beside the paths AMX does not touch.
    assert autotune.candidates("float32", "auto", True) == [
        RunPath("float32", q, amx=q == "w4a8") for q in FOUR_BIT_QUANTS]
    assert resolve_path("float32", "w4a8", TINY, "Q4_1", torch.device("cpu")) == (torch.float32, "w4a8")
    assert ops.amx_enabled()
    monkeypatch.setenv("KVSERVE_AMX", "auto")
    assert resolve_path("float32", "w4a8", TINY, "Q4_1", torch.device("cpu")) == (torch.float32, "w4a8")
    assert not ops.amx_enabled()


def test_kvserve_amx_force_without_amx_says_so_and_runs_vnni(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(autotune.ops, "amx_usable", lambda: False)
    monkeypatch.setenv("KVSERVE_AMX", "force")
    with caplog.at_level(logging.WARNING, logger="models.autotune"):
        assert autotune.candidates("float32", "w4a8", True) == [RunPath("float32", "w4a8")]
    assert "KVSERVE_AMX=force: AMX-INT8 is not usable here" in caplog.text
    monkeypatch.setenv("KVSERVE_AMX", "yes")
    with pytest.raises(ValueError, match="KVSERVE_AMX='yes': use 0"):
        autotune.candidates("float32", "w4a8", True)

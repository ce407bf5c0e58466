"""LoRA adapters through the engine: the same answer however a request was batched or
cached, beside the base model and other adapters, and a prefix cache of their own.

Every run compares logprobs bit for bit with the request computed cold and alone.
"""

from __future__ import annotations

import pytest

from engine.config import EngineConfig, LoRAModule
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.validation import InvalidRequestError
from models.loader import load_model

pytestmark = pytest.mark.slow

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
PROMPTS = ["The capital of France is", "Once upon a time, in a small village at the edge of a great forest, "
           "there lived an old clockmaker who repaired every clock in the valley, from the church tower to the "
           "smallest pocket watch", "def add(a, b):"]


@pytest.fixture(scope="module", params=[("float32", "w4a8"), ("bfloat16", "none")], ids=lambda p: "-".join(p))
def loaded(request):
    dtype, quantization = request.param
    return load_model("smollm2", dtype=dtype, device="cpu", max_positions=512, quantization=quantization)


@pytest.fixture(scope="module")
def adapters(loaded, tmp_path_factory, make_lora):
    root = tmp_path_factory.mktemp("lora")
    return (LoRAModule("sql", str(make_lora(root / "sql", loaded.config, rank=8, seed=1))),
            LoRAModule("poet", str(make_lora(root / "poet", loaded.config, rank=4, seed=2,
                                              targets=("q_proj", "v_proj")))))


def engine(loaded, adapters, **overrides) -> LLMEngine:
    # (a KV cache of 64 MiB, 2900 tokens: the default 1.5 GiB took 0.4 s an engine to claim)
    settings = dict(model="smollm2", dtype="float32", device="cpu", max_model_len=512,
                    lora_modules=adapters, max_num_batched_tokens=512, kv_cache_memory=64 << 20)
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings), loaded=loaded)


def run(llm: LLMEngine, work: list[tuple[str, list[int], str | None]], delay: dict[str, int] | None = None
        ) -> dict[str, tuple[list[int], list[float], int]]:
    """Run ``(id, prompt, adapter)`` requests to the end, ``delay`` steps late each;
    per id its tokens, logprobs and cached prompt tokens."""
    delay = delay or {}
    out: dict[str, tuple[list[int], list[float], int]] = {rid: ([], [], 0) for rid, _, _ in work}
    pending, step = list(work), 0
    while pending or llm.has_unfinished_requests():
        for item in [w for w in pending if delay.get(w[0], 0) <= step]:
            pending.remove(item)
            llm.add_request(item[0], item[1], PARAMS, adapter=item[2])
        for ro in llm.step():
            assert ro.error is None
            tokens, logprobs, _ = out[ro.request_id]
            for o in ro.outputs:
                tokens += o.token_ids
                logprobs += [lp.logprob for lp in o.logprobs or []]
            out[ro.request_id] = (tokens, logprobs, ro.num_cached_tokens)
        step += 1
    return out


def test_an_adapter_answers_the_same_alone_batched_chunked_and_cached(loaded, adapters):
    tok = loaded.tokenizer
    ids = [tok.encode(p) for p in PROMPTS]
    cold = {}
    for adapter in (None, "sql", "poet"):
        for i, prompt in enumerate(ids):
            cold[(adapter, i)] = run(engine(loaded, adapters, enable_prefix_caching=False),
                                     [("r", prompt, adapter)])["r"][:2]
    # The adapters change the answer (else nothing here would be tested).
    assert all(cold[("sql", i)][1] != cold[(None, i)][1] for i in range(len(ids)))
    assert any(cold[("poet", i)][1] != cold[(None, i)][1] for i in range(len(ids)))

    # Every prompt under every adapter at once, arriving over time (prompts beside
    # decodes), in chunks of 16 tokens, twice: the second round hits the prefix cache.
    llm = engine(loaded, adapters, max_num_batched_tokens=16)
    seen: list = []
    llm.stat_loggers.append(type("Log", (), {"record": lambda self, stats: seen.append(stats)})())
    for round_ in range(2):
        work = [(f"{adapter}-{i}", prompt, adapter) for adapter in (None, "sql", "poet")
                for i, prompt in enumerate(ids)]
        got = run(llm, work, {rid: k for k, (rid, _, _) in enumerate(work)})
        for rid, prompt, adapter in work:
            i = int(rid.rsplit("-", 1)[1])
            assert got[rid][:2] == cold[(adapter, i)], (round_, rid)
            if round_ == 1 and len(prompt) > 16:
                assert got[rid][2] > 0, rid  # served by its own adapter's cached blocks
    assert llm.kv_cache.stats.num_blocks_used == 0
    # The step stats count each adapter's sequences (the metrics' per-adapter gauges).
    assert max(s.lora_running.get("sql", 0) for s in seen) == len(ids)
    assert max(s.lora_waiting.get("poet", 0) for s in seen) >= 1
    assert seen[-1].lora_running == {"sql": 0, "poet": 0}  # every served adapter, done


def test_max_loras_runs_one_adapter_at_a_time_with_the_same_answers(loaded, adapters):
    ids = [loaded.tokenizer.encode(p) for p in PROMPTS]
    work = [(f"{adapter}-{i}", prompt, adapter) for adapter in ("sql", None, "poet") for i, prompt in enumerate(ids)]
    free = run(engine(loaded, adapters), work)
    llm = engine(loaded, adapters, max_loras=1)
    seen: list = []
    llm.stat_loggers.append(type("Log", (), {"record": lambda self, stats: seen.append(stats)})())
    assert run(llm, work) == free
    running = [{name for name, n in s.lora_running.items() if n} for s in seen]
    assert max(len(names) for names in running) == 1
    assert {"sql"} in running and {"poet"} in running
    # poet's requests waited while sql's ran, the base model's did not.
    assert any(s.lora_waiting["poet"] and s.num_running == 2 * len(ids) for s in seen)


def test_an_adapter_never_reads_another_ones_cached_blocks(loaded, adapters):
    prompt = loaded.tokenizer.encode(PROMPTS[1])
    assert len(prompt) > 32
    llm = engine(loaded, adapters)
    first = run(llm, [("base", prompt, None)])
    # The same tokens, computed for the base model and cached: no hit for an adapter...
    for adapter in ("sql", "poet"):
        got = run(llm, [(adapter, prompt, adapter)])[adapter]
        assert got[2] == 0, adapter
        assert got[:2] == run(engine(loaded, adapters, enable_prefix_caching=False),
                              [("r", prompt, adapter)])["r"][:2]
    # ...but each one's own second request hits, and so does the base model's.
    assert run(llm, [("sql-again", prompt, "sql")])["sql-again"][2] > 0
    assert run(llm, [("base-again", prompt, None)])["base-again"][2] > 0
    assert first["base"][2] == 0


def test_an_unknown_adapter_is_refused(loaded, adapters):
    llm = engine(loaded, adapters)
    with pytest.raises(InvalidRequestError, match="no LoRA adapter named 'chess'") as e:
        llm.add_request("r", [1, 2, 3], PARAMS, adapter="chess")
    assert e.value.param == "adapter"
    assert llm.lora_adapters == {"sql": adapters[0].path, "poet": adapters[1].path}


def test_adapter_settings_that_cannot_work_are_refused(loaded, adapters, tmp_path):
    with pytest.raises(ValueError, match="names must differ"):
        EngineConfig(lora_modules=(adapters[0], LoRAModule("sql", "/elsewhere")))
    with pytest.raises(ValueError, match="served model's name 'sql'"):
        EngineConfig(lora_modules=adapters, served_model_name="sql")
    with pytest.raises(ValueError, match="served model's name 'smollm2'"):
        engine(loaded, (LoRAModule("smollm2", adapters[0].path),))
    with pytest.raises(ValueError, match="has no adapter_config.json"):
        engine(loaded, (LoRAModule("missing", str(tmp_path)),))
    with pytest.raises(ValueError, match="LoRA adapter 'sql' has rank 8, above --max-lora-rank 4"):
        engine(loaded, adapters, max_lora_rank=4)
    assert engine(loaded, adapters, max_lora_rank=8).lora_adapters.keys() == {"sql", "poet"}
    for name in ("max_loras", "max_lora_rank"):
        with pytest.raises(ValueError, match=f"{name} must be at least 1, got 0"):
            EngineConfig(**{name: 0})


def test_lora_module_parses_name_equals_path():
    assert LoRAModule.parse("sql=/adapters/sql") == LoRAModule("sql", "/adapters/sql")
    for bad in ["sql", "=/x", "sql="]:
        with pytest.raises(ValueError, match="NAME=PATH"):
            LoRAModule.parse(bad)


def test_adapters_load_and_unload_while_serving(loaded, adapters):
    prompt = loaded.tokenizer.encode(PROMPTS[1])
    cold = {m.name: run(engine(loaded, adapters, enable_prefix_caching=False), [("r", prompt, m.name)])["r"][:2]
            for m in adapters}
    llm = engine(loaded, ())
    sql, poet = adapters
    llm.install_adapter(llm.read_adapter("sql", sql.path), sql.path)
    assert llm.lora_adapters == {"sql": sql.path}
    assert run(llm, [("a", prompt, "sql")])["a"][:2] == cold["sql"]

    # Unloaded with a request running: that one finishes on it, a new one is refused.
    llm.add_request("running", prompt, PARAMS, adapter="sql")
    tokens = [t for ro in llm.step() for o in ro.outputs for t in o.token_ids]
    llm.remove_adapter("sql")
    with pytest.raises(InvalidRequestError, match="no LoRA adapter named 'sql'"):
        llm.add_request("late", prompt, PARAMS, adapter="sql")
    assert len(llm.runner.adapters) == 1  # still in use
    while llm.has_unfinished_requests():
        for ro in llm.step():
            tokens += [t for o in ro.outputs for t in o.token_ids]
    assert tokens == cold["sql"][0]
    assert llm.runner.adapters == {}  # gone with its last request

    # Another adapter under the same name: its own answers, none of the old one's cached blocks.
    llm.install_adapter(llm.read_adapter("sql", poet.path), poet.path)
    got = run(llm, [("b", prompt, "sql")])["b"]
    assert got[:2] == cold["poet"] and got[2] == 0
    assert run(llm, [("c", prompt, "sql")])["c"][2] > 0  # its own blocks are found
    # Checked, then unloaded before it enters the engine: it still runs on the adapter it
    # was checked against (its weights come back for it and go again after it).
    prepared = llm.prepare("raced", prompt, PARAMS, adapter="sql")
    llm.remove_adapter("sql")
    assert llm.runner.adapters == {}
    llm.add(prepared)
    tokens = []
    while llm.has_unfinished_requests():
        tokens += [t for ro in llm.step() for o in ro.outputs for t in o.token_ids]
    assert tokens == cold["poet"][0] and llm.runner.adapters == {}
    llm.install_adapter(llm.read_adapter("sql", poet.path), poet.path)
    with pytest.raises(ValueError, match="already loaded"):
        llm.install_adapter(llm.read_adapter("sql", sql.path), sql.path)
    with pytest.raises(ValueError, match="no LoRA adapter named 'chess'"):
        llm.remove_adapter("chess")

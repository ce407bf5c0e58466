"""Prefix caching end to end on the real default model.

A request whose prompt starts with blocks another request already computed
reuses them: it runs fewer tokens through the model, reports them as cached,
and generates exactly what an engine without prefix caching generates.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_runner import kv_bytes_per_block
from engine.sampling_params import SamplingParams
from engine.stats import StepStats

pytestmark = pytest.mark.slow


BLOCK_SIZE = 16
PREFIX_LEN = 64  # four full blocks
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

SYSTEM_TEXT = (
    "You are a careful assistant for a small bakery. Answer questions about opening hours, prices and "
    "ingredients politely and briefly. The bakery opens at seven in the morning and closes at six in the "
    "evening, every day except Monday. Bread costs three euros, croissants cost one euro fifty, and all "
    "cakes are made without nuts unless the label says otherwise."
)
# Prompts part right after the prefix (which ends mid-sentence).
QUESTIONS = [" So the bakery opens at", " A croissant costs"]


def make_engine(loaded, enable_prefix_caching: bool = True, **overrides) -> LLMEngine:
    budget = 64 * kv_bytes_per_block(loaded.config, loaded.dtype, BLOCK_SIZE)
    config = EngineConfig(dtype="float32", device="cpu", kv_cache_memory=budget, block_size=BLOCK_SIZE,
                          max_model_len=256, enable_prefix_caching=enable_prefix_caching,
                          kv_cache_dtype="float32", **overrides)
    return LLMEngine(config, loaded=loaded)


class StatsRecorder:
    def __init__(self) -> None:
        self.steps: list[StepStats] = []

    def record(self, stats: StepStats) -> None:
        self.steps.append(stats)


@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    num_cached_tokens: list[int] = field(default_factory=list)  # as reported by each delta


def run(engine: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams = GREEDY) -> dict[str, Result]:
    """Add all ``prompts`` at once and step until they finish."""
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params)
    results = {rid: Result() for rid in prompts}
    while engine.has_unfinished_requests():
        for out in engine.step():
            r = results[out.request_id]
            r.token_ids.extend(out.outputs[0].token_ids)
            r.text += out.outputs[0].text
            r.num_cached_tokens.append(out.num_cached_tokens)
    assert engine.kv_cache.stats.num_blocks_used == 0
    return results


@pytest.fixture(scope="module")
def prompts(smollm2_loaded) -> dict[str, list[int]]:
    """Two prompts that share exactly their first PREFIX_LEN tokens."""
    tok = smollm2_loaded.tokenizer
    prefix = tok.encode(SYSTEM_TEXT)[:PREFIX_LEN]
    assert len(prefix) == PREFIX_LEN
    a, b = (prefix + tok.encode(q) for q in QUESTIONS)
    assert a[PREFIX_LEN] != b[PREFIX_LEN], "the prompts must part right after the shared prefix"
    return {"a": a, "b": b}


@pytest.fixture(scope="module")
def uncached(smollm2_loaded, prompts) -> dict[str, Result]:
    """Each prompt's greedy output with prefix caching off."""
    engine = make_engine(smollm2_loaded, enable_prefix_caching=False)
    results = {rid: run(engine, {rid: ids})[rid] for rid, ids in prompts.items()}
    assert engine.kv_cache.stats.prefix_cache_hits == 0
    assert all(n == 0 for r in results.values() for n in r.num_cached_tokens)
    return results


def test_second_request_reuses_the_shared_prefix(smollm2_loaded, prompts, uncached):
    engine = make_engine(smollm2_loaded)
    first = run(engine, {"a": prompts["a"]})["a"]
    recorder = StatsRecorder()
    engine.stat_loggers.append(recorder)

    second = run(engine, {"b": prompts["b"]})["b"]

    assert all(n == 0 for n in first.num_cached_tokens)
    assert all(n == PREFIX_LEN for n in second.num_cached_tokens)
    assert engine.kv_cache.stats.prefix_cache_hits == PREFIX_LEN
    assert sum(s.prefix_cache_hits for s in recorder.steps) == PREFIX_LEN
    # Only the tokens after the prefix run, then one per decode step after the first token.
    computed = sum(s.num_batched_tokens for s in recorder.steps)
    assert computed == len(prompts["b"]) - PREFIX_LEN + MAX_TOKENS - 1
    assert (first.token_ids, first.text) == (uncached["a"].token_ids, uncached["a"].text)
    assert (second.token_ids, second.text) == (uncached["b"].token_ids, uncached["b"].text)


def test_repeated_prompt_reuses_all_full_blocks_but_recomputes_the_last_token(smollm2_loaded, prompts, uncached):
    engine = make_engine(smollm2_loaded)
    run(engine, {"a1": prompts["a"]})

    again = run(engine, {"a2": prompts["a"]})["a2"]

    n = len(prompts["a"])
    assert again.num_cached_tokens[0] == (n - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert again.token_ids == uncached["a"].token_ids


def test_prefix_shared_within_one_step_gives_the_uncached_output(smollm2_loaded, prompts, uncached):
    # Both are admitted in the same step: b finds a's blocks registered before the
    # forward that writes them, so this only works if KV is written before it is read.
    engine = make_engine(smollm2_loaded)

    results = run(engine, prompts)

    assert results["b"].num_cached_tokens[0] == PREFIX_LEN
    for rid in prompts:
        assert results[rid].token_ids == uncached[rid].token_ids
        assert results[rid].text == uncached[rid].text


def test_prefix_hits_under_chunked_prefill_give_the_uncached_output(smollm2_loaded, prompts, uncached):
    engine = make_engine(smollm2_loaded, max_num_batched_tokens=24)

    results = run(engine, prompts)

    assert engine.kv_cache.stats.prefix_cache_hits > 0
    for rid in prompts:
        assert results[rid].token_ids == uncached[rid].token_ids


def test_a_cache_salt_hits_only_its_own_salts_blocks(smollm2_loaded, prompts, uncached):
    # vLLM's cache_salt: another tenant's (or the unsalted) cached prefix is no hit, the
    # same salt's is; the answers are the uncached ones either way.
    engine = make_engine(smollm2_loaded)
    salt = {name: SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, cache_salt=name)
            for name in ("tenant-a", "tenant-b")}
    run(engine, {"plain": prompts["a"]})
    a = run(engine, {"a": prompts["b"]}, salt["tenant-a"])["a"]
    b = run(engine, {"b": prompts["b"]}, salt["tenant-b"])["b"]
    a_again = run(engine, {"a2": prompts["a"]}, salt["tenant-a"])["a2"]
    assert a.num_cached_tokens[0] == 0 and b.num_cached_tokens[0] == 0
    assert a_again.num_cached_tokens[0] == PREFIX_LEN
    assert (a.token_ids, b.token_ids) == (uncached["b"].token_ids,) * 2
    assert a_again.token_ids == uncached["a"].token_ids

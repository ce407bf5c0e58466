"""Prompt logprobs: the model's logprob of each prompt token given the tokens before it.

Checked against transformers on the same weights, and bit for bit against
themselves however the prompt was computed (in one prefill, in chunks, beside
other requests, through preemption, after the same prompt was cached) and
against the logprob the same token gets where it is sampled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_runner import kv_bytes_per_block
from engine.outputs import TokenLogprob
from engine.request import Request
from engine.sampling_params import SamplingParams
from models.loader import load_model

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16
MAX_MODEL_LEN = 256
TEXT = ("The capital of France is Paris. The capital of Germany is Berlin, and the capital of Italy is Rome. "
        "Every year millions of visitors travel between these cities by train, by plane and by car, and "
        "many of them say that the best way to see Europe is slowly.")
SCORED = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=3, logprobs=3)


@dataclass
class Scored:
    """What one request returned: per sample, its prompt logprobs and generated tokens."""

    prompt_logprobs: dict[int, list[TokenLogprob | None]] = field(default_factory=dict)
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)
    num_cached_tokens: int = 0


def make_engine(loaded, num_blocks: int = 64, **overrides) -> LLMEngine:
    budget = num_blocks * kv_bytes_per_block(loaded.config, torch.float32, BLOCK_SIZE)
    settings = dict(dtype=str(loaded.dtype).removeprefix("torch."), device="cpu", kv_cache_memory=budget,
                    block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, kv_cache_dtype="float32",
                    max_num_batched_tokens=MAX_MODEL_LEN)
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings), loaded=loaded)


def run(engine: LLMEngine, prompts: dict[str, list[int]], params: dict[str, SamplingParams] | SamplingParams,
        arrivals: dict[str, int] | None = None) -> dict[str, Scored]:
    """Run every prompt to the end; ``arrivals`` delays a request by that many steps."""
    arrivals = arrivals or {}
    results = {rid: Scored() for rid in prompts}
    pending = dict(prompts)
    step = 0
    while pending or engine.has_unfinished_requests():
        for rid in [r for r in pending if arrivals.get(r, 0) <= step]:
            engine.add_request(rid, pending.pop(rid), params if isinstance(params, SamplingParams) else params[rid])
        for out in engine.step():
            assert out.error is None
            got = results[out.request_id]
            got.num_cached_tokens = out.num_cached_tokens
            for o in out.outputs:
                if o.prompt_logprobs is not None:
                    assert o.index not in got.prompt_logprobs, "prompt logprobs are sent once"
                    got.prompt_logprobs[o.index] = o.prompt_logprobs
                got.token_ids.setdefault(o.index, []).extend(o.token_ids)
                got.logprobs.setdefault(o.index, []).extend(o.logprobs or [])
        step += 1
    assert engine.kv_cache.stats.num_blocks_used == 0
    return results


@pytest.fixture(scope="module")
def prompt(smollm2_loaded) -> list[int]:
    ids = smollm2_loaded.tokenizer.encode(TEXT)
    assert len(ids) > 3 * BLOCK_SIZE
    return ids


@pytest.fixture(scope="module")
def w4a8():
    """The default path on a CPU with int8 dots: float32 activations, w4a8 projections."""
    return load_model("smollm2", dtype="float32", device="cpu", max_positions=MAX_MODEL_LEN, quantization="w4a8")


def test_prompt_logprobs_match_transformers(smollm2_loaded, reference_model, prompt):
    got = run(make_engine(smollm2_loaded), {"p": prompt}, SCORED)["p"].prompt_logprobs[0]

    with torch.no_grad():
        expected = reference_model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    assert len(got) == len(prompt) and got[0] is None
    diffs = []
    for i, entry in enumerate(got[1:], start=1):
        assert entry.token_id == prompt[i]
        diffs.append(abs(entry.logprob - expected[i - 1, prompt[i]].item()))
        # The top 3 are the model's best, best first, at transformers' values.
        assert [v for _, v in entry.top] == sorted((v for _, v in entry.top), reverse=True)
        assert entry.top[0][1] >= entry.logprob
        for token, value in entry.top:
            diffs.append(abs(value - expected[i - 1, token].item()))
        assert entry.top[0][1] == pytest.approx(expected[i - 1].max().item(), abs=2e-3)
        # Its rank: where it stands among the top 3, else below them, and (up to the
        # tokens within the tolerance of it) where transformers puts it.
        top_ids = [t for t, _ in entry.top]
        if entry.token_id in top_ids:
            assert entry.rank == top_ids.index(entry.token_id) + 1
        else:
            assert entry.rank > len(top_ids)
        row = expected[i - 1]
        assert int((row > entry.logprob + 4e-3).sum()) < entry.rank <= int((row > entry.logprob - 4e-3).sum()) + 1
    print(f"max |prompt logprob - transformers'|: {max(diffs):.2e}")
    # test_llama's bound on the logits (float32 rounding over 30 layers), doubled for the log-sum-exp.
    assert max(diffs) < 4e-3


@pytest.mark.parametrize("path", ["float32-none", "float32-w4a8"])
def test_prompt_logprobs_do_not_depend_on_how_the_prompt_was_computed(smollm2_loaded, w4a8, prompt, path):
    loaded = smollm2_loaded if path == "float32-none" else w4a8
    tokenizer = loaded.tokenizer
    cold = run(make_engine(loaded, enable_prefix_caching=False), {"p": prompt}, SCORED)["p"]

    def same(got: Scored, what: str) -> None:
        assert got.prompt_logprobs == cold.prompt_logprobs, f"{what}: other prompt logprobs"
        assert got.token_ids == cold.token_ids and got.logprobs == cold.logprobs, what

    # Chunks of 7 and 16 tokens a step.
    for budget in (7, 16):
        same(run(make_engine(loaded, max_num_batched_tokens=budget), {"p": prompt}, SCORED)["p"],
             f"chunks of {budget}")
    # Beside other requests, arriving while they decode.
    others = {f"o{i}": tokenizer.encode(t) for i, t in enumerate(["Hello", "Once upon a time", TEXT[:90]])}
    got = run(make_engine(loaded, max_num_batched_tokens=32), others | {"p": prompt},
              {rid: SamplingParams(temperature=0, max_tokens=12, ignore_eos=True) for rid in others} | {"p": SCORED},
              arrivals={"p": 3})
    same(got["p"], "in a batch")
    # A KV cache too small for everything at once: the newest request (the scored one,
    # in the middle of its prompt) is preempted while the others grow, and recomputed.
    # (Decoding requests of 1, 15 and 31 tokens cross block boundaries within a few steps.)
    growing = {"g0": prompt[:1], "g1": prompt[5:20], "g2": prompt[10:41]}
    small = make_engine(loaded, num_blocks=8, max_num_batched_tokens=16, max_model_len=7 * BLOCK_SIZE)
    preempted: list[str] = []
    schedule = small.scheduler.schedule
    small.scheduler.schedule = lambda: (out := schedule(), preempted.extend(out.preempted))[0]
    got = run(small, growing | {"p": prompt},
              {rid: SamplingParams(temperature=0, max_tokens=30, ignore_eos=True) for rid in growing} | {"p": SCORED},
              arrivals={"p": 1})
    assert "p" in preempted
    same(got["p"], "through preemption")
    # After the same prompt was cached: computed again, not served from the cache.
    cached = make_engine(loaded)
    run(cached, {"first": prompt}, SamplingParams(temperature=0, max_tokens=1))
    queries = cached.kv_cache.stats.prefix_cache_queries
    again = run(cached, {"p": prompt}, SCORED)["p"]
    assert again.num_cached_tokens == 0
    assert cached.kv_cache.stats.prefix_cache_queries == queries  # not looked up: no miss counted
    same(again, "after a prefix cache hit was possible")
    # Its blocks are cached as any request's are.
    assert run(cached, {"after": prompt}, SamplingParams(temperature=0, max_tokens=1))["after"].num_cached_tokens > 0


def test_a_prompt_token_s_logprob_is_the_one_it_gets_where_it_is_sampled(w4a8, prompt):
    engine = make_engine(w4a8)
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=3)
    sampled = run(engine, {"s": prompt}, params)["s"]
    token, logprob = sampled.token_ids[0][0], sampled.logprobs[0][0]

    longer = prompt + [token]
    scored = run(engine, {"p": longer}, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3))["p"]

    entry = scored.prompt_logprobs[0][len(prompt)]
    assert (entry.token_id, entry.logprob, entry.top) == (logprob.token_id, logprob.logprob, logprob.top)
    assert entry.rank == 1  # greedy: the best token


def test_every_sample_gets_the_prompt_logprobs(smollm2_loaded, prompt):
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=3, prompt_logprobs=0)
    got = run(make_engine(smollm2_loaded), {"p": prompt}, params)["p"]

    assert sorted(got.prompt_logprobs) == [0, 1, 2]
    first = got.prompt_logprobs[0]
    assert got.prompt_logprobs[1] == first and got.prompt_logprobs[2] == first
    # prompt_logprobs=0: each entry names its token alone.
    assert all(entry.top == [] for entry in first[1:])


def test_a_one_token_prompt_has_one_empty_entry(smollm2_loaded):
    got = run(make_engine(smollm2_loaded), {"p": [42]}, SamplingParams(max_tokens=1, prompt_logprobs=1))["p"]
    assert got.prompt_logprobs[0] == [None]


def test_prompt_logprobs_are_validated():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    assert Request("r", [1, 2, 3], SamplingParams(prompt_logprobs=0), max_tokens=1).needs_prompt_logits
    assert not Request("r", [1], SamplingParams(prompt_logprobs=0), max_tokens=1).needs_prompt_logits

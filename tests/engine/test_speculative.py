"""Speculative decoding by prompt lookup: the proposer, and exactness in the engine.

The engine must give a request the same tokens with speculation on as off: the
proposals run as extra positions of the request, and only those the model
itself would have produced are kept. Every check compares whole outputs (token
ids, text, finish reason) with and without speculation, on prompts that make
the model quote itself (so proposals are made and many are accepted).
"""

from __future__ import annotations

import random

import pytest

from engine.config import EngineConfig, SpeculativeConfig
from engine.llm_engine import LLMEngine
from engine.model_runner import kv_bytes_per_block
from engine.sampling_params import SamplingParams
from engine.speculative import NgramIndex, NgramProposer
from engine.stats import StepStats


# smollm2_loaded: the default model on its served path (tests/conftest.py)
SERVED_PATH = True

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16
PARAGRAPH = ("The quick brown fox jumps over the lazy dog. The dog sleeps under the old oak tree "
             "while the fox runs across the green field towards the river, where the water is cold "
             "and clear, and the fish swim slowly in the morning light.")
QUOTES = [
    f"Repeat this text exactly.\n\nText: {PARAGRAPH}\n\nRepeated text: {PARAGRAPH[:40]}",
    "Copy the sentence: 'the water is cold and clear, and the fish swim'. Copy: 'the water is",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25,",
]


def test_the_proposer_takes_the_longest_latest_match():
    p = NgramProposer(ngram_min=1, ngram_max=3, num_tokens=3)
    # The 3-gram (1, 2, 3) occurred at 0 and 5: the latest (5) continues with 9, 9.
    assert p.propose([1, 2, 3, 7, 8, 1, 2, 3, 9, 9, 1, 2, 3], limit=8) == [9, 9, 1]
    assert p.propose([5, 6, 4, 6], limit=8) == [4, 6]  # only a 1-gram matches
    assert p.propose([1, 2, 3, 4], limit=8) == []  # nothing repeats
    assert p.propose([1, 2, 1, 2, 1, 2], limit=2) == [1, 2]  # capped by the limit
    assert p.propose([1, 2, 1, 2], limit=0) == []
    # The engine's incremental index proposes what the scan does, step by step.
    rng = random.Random(0)
    for trial in range(20):
        index, scan = NgramIndex(1, 3, 4), NgramProposer(1, 3, 4)
        tokens = [rng.randrange(6) for _ in range(rng.randrange(1, 5))]
        for _ in range(120):
            assert index.propose(tokens, 5) == scan.propose(tokens, 5), (trial, tokens)
            tokens += [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
    with pytest.raises(ValueError, match="ngram_min"):
        SpeculativeConfig(ngram_min=3, ngram_max=2)
    with pytest.raises(ValueError, match="speculative must be"):
        SpeculativeConfig(method="eagle")


class Recorder:
    def __init__(self) -> None:
        self.steps: list[StepStats] = []

    def record(self, stats: StepStats) -> None:
        self.steps.append(stats)


def make_engine(loaded, num_blocks: int = 64, draft=None, **overrides) -> LLMEngine:
    budget = num_blocks * kv_bytes_per_block(loaded.config, loaded.dtype, BLOCK_SIZE)
    settings = dict(dtype="float32", device="cpu", kv_cache_memory=budget, block_size=BLOCK_SIZE,
                    max_model_len=512, kv_cache_dtype="float32") | overrides
    engine = LLMEngine(EngineConfig(**settings), loaded=loaded, draft=draft)
    engine.stat_loggers.append(recorder := Recorder())
    engine.recorder = recorder
    return engine


def run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> list[tuple]:
    """Every request to the end: (token ids, text, finish reason, stop reason) per sample."""
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp)
    samples: dict[tuple[str, int], list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for o in out.outputs:
                s = samples.setdefault((out.request_id, o.index), [[], "", None, None])
                s[0] += o.token_ids
                s[1] += o.text
                s[2], s[3] = o.finish_reason, o.stop_reason
    assert engine.kv_cache.stats.num_blocks_used == 0, "a block outlived its request"
    return [tuple(samples[k]) for k in sorted(samples)]


@pytest.fixture(scope="module")
def prompts(smollm2_loaded) -> list[list[int]]:
    tok = smollm2_loaded.tokenizer
    return [tok.encode(q) for q in QUOTES]


def accepted(engine: LLMEngine) -> tuple[int, int]:
    steps = engine.recorder.steps
    return sum(s.spec_draft_tokens for s in steps), sum(s.spec_accepted_tokens for s in steps)


def test_greedy_output_is_the_same_with_speculation(smollm2_loaded, prompts):
    greedy = SamplingParams(temperature=0, max_tokens=60)
    mixed = [greedy, SamplingParams(temperature=0, max_tokens=40, stop=["fish"]),
             SamplingParams(temperature=0, max_tokens=33, ignore_eos=True),
             # Sampled with a seed, and with logprobs: verified by sampling each position.
             SamplingParams(temperature=0.8, seed=7, max_tokens=30),
             SamplingParams(temperature=0, max_tokens=20, logprobs=2)]
    batch = [prompts[0], prompts[1], prompts[2], prompts[2], prompts[0]]
    plain = run(make_engine(smollm2_loaded), batch, mixed)
    engine = make_engine(smollm2_loaded, speculative=SpeculativeConfig(num_speculative_tokens=4, max_batch=8))
    assert run(engine, batch, mixed) == plain
    draft, kept = accepted(engine)
    assert draft > 0 and kept > draft // 4, (draft, kept)  # quoting: many proposals kept
    # One at a time, each speculating alone.
    alone = make_engine(smollm2_loaded, speculative=SpeculativeConfig(max_batch=1))
    assert [run(alone, [p], [sp])[0] for p, sp in zip(batch, mixed)] == plain
    assert accepted(alone)[1] > 0


def test_sampling_logprobs_and_processors_are_the_same_with_speculation(smollm2_loaded, prompts):
    settings = [SamplingParams(temperature=0.7, seed=11, max_tokens=60, repetition_penalty=1.1),
                SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=5, max_tokens=60, n=2),
                SamplingParams(temperature=0.5, seed=3, max_tokens=50, logprobs=3),
                SamplingParams(temperature=0, max_tokens=50, logprobs=1),
                # Logits processors: each proposed position sees the proposals before it.
                SamplingParams(temperature=0, max_tokens=50, presence_penalty=0.5, frequency_penalty=0.3,
                               logit_bias={13: -2.0}),
                SamplingParams(temperature=0, max_tokens=40, min_tokens=30, repetition_penalty=1.2),
                # llama.cpp's samplers: XTC's coin comes from the generator too, DRY reads the proposals.
                SamplingParams(temperature=0.9, seed=21, max_tokens=50, xtc_probability=0.5, typical_p=0.9,
                               top_n_sigma=2.0, dry_multiplier=0.3, dry_allowed_length=4),
                SamplingParams(temperature=0, max_tokens=40, dry_multiplier=0.5, dry_allowed_length=3),
                # Mirostat runs without proposals (its mu after one depends on the row before).
                SamplingParams(temperature=0.8, seed=8, max_tokens=40, mirostat=2, mirostat_tau=3.0)]
    batch = [prompts[0], prompts[1], prompts[0], prompts[2], prompts[0], prompts[2], prompts[0], prompts[1],
             prompts[0]]

    def outputs(engine: LLMEngine) -> list:
        for i, (p, sp) in enumerate(zip(batch, settings)):
            engine.add_request(f"s{i}", p, sp)
        got: dict = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                for o in out.outputs:
                    g = got.setdefault((out.request_id, o.index), [[], "", []])
                    g[0] += o.token_ids
                    g[1] += o.text
                    g[2] += [(lp.token_id, lp.logprob, lp.top) for lp in o.logprobs or []]
        assert engine.kv_cache.stats.num_blocks_used == 0
        return [got[k] for k in sorted(got)]

    plain = outputs(make_engine(smollm2_loaded))
    engine = make_engine(smollm2_loaded, speculative=SpeculativeConfig(max_batch=8))
    assert outputs(engine) == plain
    draft, kept = accepted(engine)
    # Some proposals kept, some rejected (so seeded generators were wound back).
    assert 0 < kept < draft, (kept, draft)


def test_structured_outputs_are_the_same_with_speculation(smollm2_loaded):
    from engine.sampling_params import StructuredOutput

    tok = smollm2_loaded.tokenizer
    ask = tok.apply_chat_template([{"role": "user", "content": f"Put this text in a JSON object as 'text': {PARAGRAPH}"}])
    prompt = tok.encode(ask, add_special_tokens=False)
    schema = {"type": "object", "properties": {"text": {"type": "string", "maxLength": 300},
                                               "words": {"type": "integer"}},
              "required": ["text", "words"], "additionalProperties": False}
    settings = [SamplingParams(temperature=0, max_tokens=80, structured=StructuredOutput("json", schema)),
                SamplingParams(temperature=0.6, seed=2, max_tokens=80, structured=StructuredOutput("json", schema)),
                SamplingParams(temperature=0, max_tokens=40,
                               structured=StructuredOutput("regex", r"The (quick|slow) brown fox jumps over the lazy (dog|cat)\. [a-z ]{1,40}"))]
    batch = [prompt, prompt, prompts_of(tok, QUOTES[0])]
    plain = run(make_engine(smollm2_loaded), batch, settings)
    engine = make_engine(smollm2_loaded, speculative=SpeculativeConfig(max_batch=8))
    assert run(engine, batch, settings) == plain
    draft, kept = accepted(engine)
    assert kept > 0, (kept, draft)


def prompts_of(tok, text: str) -> list[int]:
    return tok.encode(text)


def test_rejected_proposals_never_reach_the_prefix_cache(smollm2_loaded, prompts):
    params = [SamplingParams(temperature=0, max_tokens=70, ignore_eos=True)] * 3
    engine = make_engine(smollm2_loaded, speculative=SpeculativeConfig(num_speculative_tokens=8))
    first = run(engine, prompts, params)
    draft, kept = accepted(engine)
    assert kept < draft, "some proposals must have been rejected for this test to mean anything"
    # The same requests again, cached blocks and all, now speculating or not: if a block
    # had been registered with a rejected proposal in it, these answers would change.
    again = [p + t[0][:50] for p, t in zip(prompts, first)]
    cont = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)] * 3
    cached = run(engine, again, cont)
    assert sum(s.prefix_cache_hits for s in engine.recorder.steps) > 0
    assert cached == run(make_engine(smollm2_loaded, enable_prefix_caching=False), again, cont)


def test_preemption_and_aborts_with_speculation(smollm2_loaded, prompts):
    params = [SamplingParams(temperature=0, max_tokens=90, ignore_eos=True)] * 3
    plain = run(make_engine(smollm2_loaded), prompts, params)
    # Three requests of 7-9 blocks in 16 blocks: some are preempted and recomputed.
    small = make_engine(smollm2_loaded, num_blocks=16, max_model_len=256, speculative=SpeculativeConfig())
    assert run(small, prompts, params) == plain
    assert small.scheduler.num_preemptions_total > 0 and accepted(small)[1] > 0
    # Aborted mid-way, proposals in flight: every block comes back.
    engine = make_engine(smollm2_loaded, speculative=SpeculativeConfig())
    for i, p in enumerate(prompts):
        engine.add_request(f"a{i}", p, params[0])
    for _ in range(12):
        engine.step()
    assert accepted(engine)[0] > 0
    for i in range(len(prompts)):
        engine.abort_request(f"a{i}")
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.stats.num_blocks_used == 0


def test_speculation_stays_off_in_large_batches(smollm2_loaded, prompts):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (8, 10, 12, 14, 40, 60)]
    engine = make_engine(smollm2_loaded, speculative=SpeculativeConfig(max_batch=2))
    batch = [prompts[i % 3] for i in range(6)]
    run(engine, batch, params)
    for s in engine.recorder.steps:
        if s.num_running > 2 and s.spec_drafts:  # num_running is after the step: at most what ran
            raise AssertionError(f"speculated in a step with {s.num_running} running")
    assert accepted(engine)[0] > 0  # it did speculate once the batch had shrunk


def test_each_proposed_position_is_processed_with_the_proposals_before_it(smollm2_loaded, prompts):
    # Penalties and min_tokens read a request's output so far: at the j-th proposed
    # position that output must include the j proposals before it.
    engine = make_engine(smollm2_loaded, speculative=SpeculativeConfig())
    seen: list[list[tuple[int, int]]] = []  # per call: (output length, last output token) per row
    sample = engine.sampler.__class__.__call__

    def spy(sampler, logits, requests, masks=None):
        if len({r.request_id for r in requests}) == 1 and len(requests) > 1:  # one request's proposals
            seen.append([(r.num_output_tokens, r.output_token_ids[-1]) for r in requests])
        return sample(sampler, logits, requests, masks)

    engine.sampler.__class__.__call__ = spy
    try:
        run(engine, [prompts[2]], [SamplingParams(temperature=0, max_tokens=40, repetition_penalty=1.1,
                                                  min_tokens=20)])
    finally:
        engine.sampler.__class__.__call__ = sample
    assert seen
    for rows in seen:
        counts = [n for n, _ in rows]
        assert counts == list(range(counts[0], counts[0] + len(rows)))

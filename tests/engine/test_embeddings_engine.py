"""Embedding requests through the engine: transformers' last hidden state, and the same
bits however the request was batched, chunked or cached."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import PoolingParams, SamplingParams
from engine.validation import InvalidRequestError
from models.loader import load_model

pytestmark = pytest.mark.slow

TEXTS = ["The capital of France is Paris.", "def add(a, b):\n    return a + b",
         "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker "
         "who repaired every clock in the valley, from the church tower to the smallest pocket watch."]
GENERATE = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def embed_params(**pooling) -> SamplingParams:
    return SamplingParams.embedding(PoolingParams(**pooling))


def run(llm: LLMEngine, work: list[tuple[str, list[int], SamplingParams]], delay: dict[str, int] | None = None
        ) -> dict[str, tuple]:
    """Run requests to the end, ``delay`` steps late each: per id its embedding (or tokens)
    and its cached prompt tokens."""
    delay = delay or {}
    out: dict[str, tuple] = {}
    tokens: dict[str, list[int]] = {}
    pending, step = list(work), 0
    while pending or llm.has_unfinished_requests():
        for item in [w for w in pending if delay.get(w[0], 0) <= step]:
            pending.remove(item)
            llm.add_request(*item)
        for ro in llm.step():
            assert ro.error is None
            for o in ro.outputs:
                tokens.setdefault(ro.request_id, []).extend(o.token_ids)
                if ro.finished:
                    out[ro.request_id] = (o.embedding if o.embedding is not None else tokens[ro.request_id],
                                          ro.num_cached_tokens)
        step += 1
    return out


@pytest.fixture(scope="module")
def default_path():
    return load_model("smollm2", dtype="float32", device="cpu", max_positions=512, quantization="w4a8")


def engine(loaded, **overrides) -> LLMEngine:
    # (a KV cache of 64 MiB: the default 1.5 GiB took 0.4 s an engine to claim)
    settings = dict(model="smollm2", dtype="float32", device="cpu", max_model_len=512, kv_cache_memory=64 << 20)
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings), loaded=loaded)


def test_an_embedding_is_transformers_last_hidden_state(smollm2_loaded, reference_model):
    llm = engine(smollm2_loaded, kv_cache_dtype="float32")  # the default float16 cache moves it ~2e-3
    for text in TEXTS:
        ids = llm.tokenizer.encode(text)
        [[result]] = [[r] for r in run(llm, [("e", ids, embed_params(normalize=False))]).values()]
        ours = torch.tensor(result[0])
        with torch.no_grad():
            # The last of transformers' hidden states is the final norm's output.
            expected = reference_model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, -1]
        torch.testing.assert_close(ours, expected, atol=2e-4, rtol=0)
        unit = run(llm, [("n", ids, embed_params())])["n"][0]
        torch.testing.assert_close(torch.tensor(unit), torch.nn.functional.normalize(expected, dim=0),
                                   atol=1e-5, rtol=0)
        short = run(llm, [("d", ids, embed_params(dimensions=64))])["d"][0]
        torch.testing.assert_close(torch.tensor(short), torch.nn.functional.normalize(expected[:64], dim=0),
                                   atol=1e-5, rtol=0)
    assert llm.kv_cache.stats.num_blocks_used == 0


def test_an_embedding_is_the_same_alone_batched_chunked_and_cached(default_path):
    cold_engine = engine(default_path, enable_prefix_caching=False)
    ids = [cold_engine.tokenizer.encode(t) for t in TEXTS]
    cold = {i: run(cold_engine, [("e", p, embed_params())])["e"][0] for i, p in enumerate(ids)}
    gen_cold = {i: run(cold_engine, [("g", p, GENERATE)])["g"][0] for i, p in enumerate(ids)}

    # Embeddings beside generations, arriving over time, in chunks of 16 tokens, twice
    # (the second round hits the prefix cache, the first one's blocks).
    llm = engine(default_path, max_num_batched_tokens=16)
    for round_ in range(2):
        work = [(f"e{i}", p, embed_params()) for i, p in enumerate(ids)]
        work += [(f"g{i}", p[::-1], GENERATE) for i, p in enumerate(ids)]
        got = run(llm, work, {rid: k for k, (rid, _, _) in enumerate(work)})
        for i in range(len(ids)):
            assert got[f"e{i}"][0] == cold[i], (round_, i)
            if round_ == 1 and len(ids[i]) > 16:
                assert got[f"e{i}"][1] > 0
        generated = {i: run(engine(default_path), [("g", p[::-1], GENERATE)])["g"][0] for i, p in enumerate(ids)}
        assert all(got[f"g{i}"][0] == generated[i] for i in range(len(ids)))
    assert gen_cold  # generation requests of the same prompts run too
    assert llm.kv_cache.stats.num_blocks_used == 0


def test_what_an_embedding_request_may_ask(default_path):
    llm = engine(default_path, max_model_len=64)
    with pytest.raises(InvalidRequestError, match="dimensions must be at most 576") as e:
        llm.add_request("r", [1, 2, 3], embed_params(dimensions=577))
    assert e.value.param == "dimensions"
    # It generates nothing: a prompt may fill the whole context, and no more.
    assert len(run(llm, [("full", list(range(100, 164)), embed_params())])["full"][0]) == 576
    with pytest.raises(InvalidRequestError, match="maximum context length is 64"):
        llm.add_request("r", list(range(100, 165)), embed_params())
    for bad in (dict(n=2), dict(max_tokens=2), dict(logprobs=0), dict(prompt_logprobs=0)):
        with pytest.raises(ValueError, match="samples nothing"):
            SamplingParams(**{"max_tokens": 1, **bad}, pooling=PoolingParams())
    with pytest.raises(ValueError, match="dimensions must be at least 1"):
        PoolingParams(dimensions=0)

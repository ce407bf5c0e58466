"""llama.cpp's samplers beyond vLLM's: DRY, XTC, top-n-sigma, locally typical sampling
and mirostat.

Each is checked against a reference: typical-p against transformers' warper, the
others against straight ports of llama.cpp's loops (src/llama-sampling.cpp), written
here as plainly as llama.cpp writes them; in the engine, DRY on the real model
against the same step run with the reference's penalties as a logit bias, and
seeded requests with every sampler the same alone, batched and preempted.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from engine.config import EngineConfig
from engine.dry import dry_breakers, dry_penalties
from engine.llm_engine import LLMEngine
from engine.logits_processors import apply_logits_processors
from engine.mirostat import apply_mirostat, mirostat_update
from engine.model_runner import kv_bytes_per_block
from engine.request import Request
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.truncation import (apply_temperature_last, apply_top_k_top_p, apply_top_n_sigma, apply_typical_p,
                               apply_xtc)


# smollm2_loaded: the default model on its served path (tests/conftest.py)
SERVED_PATH = True

# --------------------------------------------------------------------------- references


def llama_cpp_dry(tokens: list[int], multiplier: float, base: float, allowed: int, last_n: int,
                  breakers: dict[int, list[tuple[int, ...]]]) -> dict[int, float]:
    """llama.cpp's ``llama_sampler_dry_apply``: restart sequences, the reverse Z-algorithm,
    the longest repeat each next token would extend, and the penalty."""
    if multiplier == 0 or base < 1 or last_n == 0:
        return {}
    n = min(len(tokens), len(tokens) if last_n == -1 else last_n)
    if n <= allowed:
        return {}

    def rat(i: int) -> int:  # i tokens from the end
        return tokens[len(tokens) - 1 - i]

    rep_limit = n
    for i in range(n):
        longest = -1
        for tail in breakers.get(rat(i), []):
            if longest < len(tail) <= i and all(tail[o] == rat(i - o - 1) for o in range(len(tail))):
                longest = len(tail)
        if longest >= 0:
            rep_limit = i - longest
            break
    if rep_limit < allowed:
        return {}
    count = [0] * n
    last, rt, lt = n - 1, 0, 0
    for k in range(1, n):
        if k > rt:
            m = 0
            while m + k < n and rat(m) == rat(m + k):
                m += 1
            count[last - k] = min(m, rep_limit)
            if m > 0:
                lt, rt = k, k + m - 1
        else:
            p, right = k - lt, rt - k + 1
            if count[last - p] < right:
                count[last - k] = min(count[last - p], rep_limit)
            else:
                i = rt + 1
                while i < n and rat(i) == rat(i - k):
                    i += 1
                count[last - k] = min(i - k, rep_limit)
                lt, rt = k, i - 1
    max_repeat: dict[int, int] = {}
    for i in range(n - 1):
        if count[i] >= allowed:
            token = rat(n - 2 - i)
            max_repeat[token] = max(max_repeat.get(token, 0), count[i])
    max_exponent = int(88.7228391 / math.log(base)) if base > 1.000001 else 0
    out = {}
    for token, length in max_repeat.items():
        if any(len(t) == 0 for t in breakers.get(token, [])):
            continue
        exponent = length - allowed
        if max_exponent > 0 and exponent > max_exponent:
            exponent = max_exponent
        out[token] = multiplier * base ** exponent
    return out


def llama_cpp_xtc(probs: list[float], threshold: float) -> set[int]:
    """The tokens llama.cpp's XTC drops once its coin came up (probabilities of a row)."""
    order = sorted(range(len(probs)), key=lambda t: -probs[t])
    pos_last = 0
    for i, t in enumerate(order):
        if probs[t] >= threshold:
            pos_last = i
        else:
            break
    return set(order[:pos_last])


def llama_cpp_mirostat(probs: list[float], mu: float, version: int, m: int = 100) -> list[int]:
    """The tokens llama.cpp's mirostat (``llama_sampler_mirostat_apply`` and ``_v2_apply``)
    keeps of a row's probabilities (its candidates, sorted, then cut). As kvserve, the fit
    of version 1 reads only tokens of probability above 0."""
    order = sorted(range(len(probs)), key=lambda t: -probs[t])
    if version == 2:
        # (-log2f(0) is inf in C: a masked token is past any mu.)
        size = next((i for i, t in enumerate(order) if probs[t] == 0 or -math.log2(probs[t]) > mu), len(order))
        return order[:max(size, 1)]
    cands = [t for t in order if probs[t] > 0]
    sum_ti_bi = sum_ti_sq = 0.0
    for i in range(min(m - 1, len(cands) - 1)):
        t_i = math.log((i + 2) / (i + 1))
        b_i = math.log(probs[cands[i]] / probs[cands[i + 1]])
        sum_ti_bi += t_i * b_i
        sum_ti_sq += t_i * t_i
    s_hat = sum_ti_bi / sum_ti_sq
    eps = s_hat - 1
    k = ((eps * 2 ** mu) / (1 - len(probs) ** -eps)) ** (1 / s_hat)
    return cands[:max(int(k), 1)]


def params(**kw) -> SamplingParams:
    return SamplingParams(**kw)


# --------------------------------------------------------------------------- DRY


def test_dry_follows_llama_cpps_example_and_its_loops():
    # llama.cpp's comment: "a b c c b c y a b c" ends with "a b c", which also stands at the
    # start (so c, which followed it, would make 4) and "b c" before y (so y would make 3).
    a, b, c, y = 1, 2, 3, 4
    got = dry_penalties([a, b, c, c, b, c, y, a, b, c], params(dry_multiplier=0.8), {})
    assert got == {c: 0.8 * 1.75 ** 1, y: 0.8 * 1.75 ** 0}
    # A single-token breaker ends every repeat at it; a token that is a breaker is never penalised.
    assert dry_penalties([a, b, c, y, a, b, c], params(dry_multiplier=1.0), {y: ((),)}) == {}
    assert dry_penalties([a, b, y, a, b], params(dry_multiplier=1.0), {y: ((),)}) == {}
    # Off: no multiplier, no window; a window shorter than the repeat hides it.
    assert dry_penalties([a, b, c, a, b], params(), {}) == {}
    assert dry_penalties([a, b, c, a, b], params(dry_multiplier=1.0, dry_penalty_last_n=0), {}) == {}
    assert dry_penalties([a, b, c, a, b], params(dry_multiplier=1.0, dry_penalty_last_n=4), {}) == {}
    assert dry_penalties([a, b, c, a, b], params(dry_multiplier=1.0, dry_penalty_last_n=5), {}) == {c: 1.0}


def test_dry_equals_llama_cpps_z_algorithm_on_random_contexts():
    rng = random.Random(0)
    checked = penalised = 0
    for trial in range(3000):
        alphabet = rng.randint(2, 6)
        tokens = [rng.randrange(alphabet) for _ in range(rng.randint(0, 60))]
        if rng.random() < 0.3:  # a loop, as a model stuck in one writes
            period = rng.randint(1, 5)
            tokens += (tokens[-period:] or [0]) * rng.randint(2, 8)
        breakers: dict[int, list[tuple[int, ...]]] = {}
        for _ in range(rng.randint(0, 3)):
            head = rng.randrange(alphabet + 1)
            tail = tuple(rng.randrange(alphabet) for _ in range(rng.choice([0, 0, 1, 2])))
            if tail not in breakers.setdefault(head, []):
                breakers[head].append(tail)
        p = params(dry_multiplier=rng.choice([0.5, 0.8, 2.0]), dry_base=rng.choice([1.0, 1.1, 1.75, 3.0]),
                   dry_allowed_length=rng.randint(1, 4), dry_penalty_last_n=rng.choice([-1, 5, 12, 40]))
        want = llama_cpp_dry(tokens, p.dry_multiplier, p.dry_base, p.dry_allowed_length, p.dry_penalty_last_n,
                             breakers)
        got = dry_penalties(tokens, p, {h: tuple(t) for h, t in breakers.items()})
        assert got == want, (trial, tokens, breakers, p)
        checked += 1
        penalised += bool(want)
    assert penalised > checked // 3  # the contexts did repeat


def test_dry_breakers_are_found_as_llama_cpp_finds_them():
    vocab = [b"a", b"\n", b"x\ny", b"b", b"c", b"xb", b":c", b"b:c!", b""]

    def encode(text: str) -> list[int]:  # longest match first, over the vocabulary above
        out, rest = [], text.encode()
        while rest:
            token = max((t for t, w in enumerate(vocab) if w and rest.startswith(w)), key=lambda t: len(vocab[t]))
            out.append(token)
            rest = rest[len(vocab[token]):]
        return out

    # "\n" lies inside tokens 1 and 2; "b:c" inside 7, and tokens ending in its start
    # ("b") are heads followed by the rest (":c", token 6).
    assert dry_breakers(vocab, encode, ["\n", "b:c"]) == {1: ((),), 2: ((),), 7: ((),), 3: ((6,),), 5: ((6,),)}
    assert dry_breakers(vocab, encode, []) == {}


# --------------------------------------------------------------------------- repeat_last_n


def test_repeat_last_n_counts_the_last_tokens_of_prompt_and_answer_for_every_penalty():
    def processed(**kw) -> list[float]:
        sp = SamplingParams(temperature=0, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25, **kw)
        request = Request("r", [1, 2, 2, 3], sp, max_tokens=8)
        request.output_token_ids = [4, 2, 5]
        return apply_logits_processors(torch.full((1, 8), 4.0), [request])[0].tolist()

    # vLLM's way: repetition over prompt and answer, presence and frequency over the answer.
    assert processed() == [4.0, 2.0, 2 - 0.75, 2.0, 2 - 0.75, 2 - 0.75, 4.0, 4.0]
    # llama.cpp's: all three over the last 4 tokens of 1 2 2 3 | 4 2 5, that is 3 4 2 5, once each.
    assert processed(repeat_last_n=4) == [4.0, 4.0, 2 - 0.75, 2 - 0.75, 2 - 0.75, 2 - 0.75, 4.0, 4.0]
    # All of them: 1 once, 2 three times.
    assert processed(repeat_last_n=-1) == [4.0, 2 - 0.75, 2 - 0.5 - 0.75, 2 - 0.75, 2 - 0.75, 2 - 0.75, 4.0, 4.0]
    assert processed(repeat_last_n=0) == [4.0] * 8
    with pytest.raises(ValueError, match="repeat_last_n"):
        SamplingParams(repeat_last_n=-2)


# --------------------------------------------------------------------------- truncations


def test_typical_p_keeps_what_transformers_keeps():
    from transformers.generation.logits_process import TypicalLogitsWarper

    torch.manual_seed(0)
    logits = torch.randn(8, 300) * torch.tensor([0.5, 1, 2, 4, 1, 2, 3, 1]).unsqueeze(1)
    logits[5, :100] = float("-inf")  # already masked tokens stay masked, and count for nothing
    masses = [0.2, 0.5, 0.9, 0.95, 0.3, 0.7, 0.99, 1.0]
    got = apply_typical_p(logits, torch.tensor(masses))
    for row, mass in enumerate(masses):
        if mass == 1.0:
            assert torch.equal(got[row], logits[row])
            continue
        want = TypicalLogitsWarper(mass=mass)(torch.zeros(1, 1, dtype=torch.long), logits[row:row + 1].clone())[0]
        assert torch.equal(got[row], want), row
        assert 1 <= torch.isfinite(got[row]).sum() < torch.isfinite(logits[row]).sum()
    # Inside the sampler's sort, after top-k: the same as typical-p alone on the top-k's logits.
    top_k = apply_top_k_top_p(logits, torch.full((8,), 50), None)
    both = apply_top_k_top_p(logits, torch.full((8,), 50), None, torch.tensor(masses))
    assert torch.equal(torch.isinf(both), torch.isinf(apply_typical_p(top_k, torch.tensor(masses))))


def test_top_n_sigma_keeps_logits_within_n_deviations_of_the_largest():
    torch.manual_seed(1)
    logits = torch.randn(5, 400) * 2
    logits[2, ::3] = float("-inf")
    n = torch.tensor([1.0, 2.0, 0.5, 0.0, -1.0])
    got = apply_top_n_sigma(logits, n)
    for row in range(5):
        finite = logits[row][torch.isfinite(logits[row])].double()
        if n[row] <= 0:
            assert torch.equal(got[row], logits[row])
            continue
        floor = finite.max() - n[row].double() * finite.std(unbiased=False)
        want = logits[row].double() >= floor
        assert torch.equal(torch.isfinite(got[row]), want), row
        assert torch.equal(got[row][want], logits[row][want])


def test_xtc_drops_the_likely_tokens_but_the_least_of_them_as_llama_cpp():
    torch.manual_seed(2)
    logits = torch.randn(6, 12) * torch.tensor([0.3, 0.6, 1.0, 3.0, 0.3, 5.0]).unsqueeze(1)
    threshold = torch.tensor([0.1, 0.1, 0.05, 0.1, 0.5, 0.1])
    excluded = torch.tensor([True, True, True, True, False, True])
    got = apply_xtc(logits, threshold, excluded)
    dropped_any = 0
    for row in range(6):
        probs = logits[row].softmax(-1).tolist()
        drop = llama_cpp_xtc(probs, float(threshold[row])) if excluded[row] else set()
        assert {t for t in range(12) if got[row, t] == float("-inf")} == drop, row
        dropped_any += bool(drop)
    assert dropped_any >= 3


def llama_cpp_temp_ext(logits: list[float], temp: float, delta: float, exponent: float) -> list[float]:
    """llama.cpp's ``llama_sampler_temp_ext_apply`` on the candidates left (finite logits)."""
    kept = [x for x in logits if x != float("-inf")]
    if delta <= 0:
        return [x / temp for x in logits]
    if len(kept) <= 1:
        return list(logits)
    low, high = max(0.0, temp - delta), temp + delta
    top = max(kept)
    weights = [math.exp(x - top) for x in kept]
    probs = [w / sum(weights) for w in weights]
    entropy = -sum(p * math.log(p) for p in probs if p > 0)
    dyn = low + (high - low) * (entropy / -math.log(1.0 / len(kept))) ** exponent
    return [x / dyn for x in logits]


def test_dynamic_temperature_is_llama_cpps():
    torch.manual_seed(3)
    logits = torch.randn(4, 50) * 3
    logits[1, 10:] = float("-inf")  # what the truncations left
    logits[2, 1:] = float("-inf")   # one token left: as it is
    settings = [params(temperature=0.8, dynatemp_range=0.5), params(temperature=1.0, dynatemp_range=1.0,
                                                                    dynatemp_exponent=2.0),
                params(temperature=0.7, dynatemp_range=0.5), params(temperature=0.6, temperature_last=True)]
    got = apply_temperature_last(logits, settings)
    for row, p in enumerate(settings):
        want = llama_cpp_temp_ext(logits[row].tolist(), p.temperature, p.dynatemp_range, p.dynatemp_exponent)
        assert torch.allclose(got[row], torch.tensor(want), rtol=1e-5, equal_nan=False), row
    # A range reaching 0 on a one-sided distribution: temperature 0 keeps only the largest.
    peaked = torch.tensor([[30.0, 0.0, 0.0]])
    out = apply_temperature_last(peaked, [params(temperature=0.2, dynatemp_range=0.2, dynatemp_exponent=50.0)])
    assert out[0, 0] == 30.0 and torch.isinf(out[0, 1:]).all()


def test_temperature_last_truncates_the_logits_as_they_are():
    # top_p 0.5 on these logits keeps tokens 0 and 1; at temperature 3 first, the flatter
    # distribution's nucleus holds more, and sampling reaches past them.
    logits = torch.tensor([[3.0, 2.5, 2.0, 1.5, 1.0, 0.5, 0.0, -0.5]]).repeat(4000, 1)
    sampler = Sampler(8)

    def picks(**kw) -> set[int]:
        sp = SamplingParams(temperature=3.0, top_p=0.5, **kw)
        requests = [Request(f"r{i}", [1], sp, max_tokens=4) for i in range(4000)]
        return set(sampler(logits, requests).token_ids)

    assert picks(temperature_last=True) == {0, 1}
    assert len(picks()) > 2
    assert picks(dynatemp_range=1.0) == {0, 1}


def test_a_sampler_order_runs_those_samplers_in_that_order_and_no_others():
    logits = torch.tensor([[3.0, 2.5, 2.0, 1.5, 1.0, 0.5, 0.0, -0.5]]).repeat(4000, 1)
    sampler = Sampler(8)

    def picks(**kw) -> list[int]:
        sp = SamplingParams(seed=3, **kw)
        requests = [Request(f"r{i}", [1], dataclasses.replace(sp, seed=i), max_tokens=4) for i in range(4000)]
        return sampler(logits, requests).token_ids

    # The order of the temperature and top-p: llama.cpp's (truncate, then divide) is
    # temperature_last, vLLM's (divide, then truncate) the default.
    assert picks(temperature=3.0, top_p=0.5, samplers=("top_p", "temperature")) == picks(
        temperature=3.0, top_p=0.5, temperature_last=True)
    assert picks(temperature=3.0, top_p=0.5, samplers=("temperature", "top_p")) == picks(temperature=3.0, top_p=0.5)
    assert set(picks(temperature=3.0, top_p=0.5, samplers=("top_p", "temperature"))) == {0, 1}
    # What the order leaves out is not applied: top_k 1 and min_p without their steps.
    assert len(set(picks(temperature=1.0, top_k=1, min_p=0.9, samplers=("temperature",)))) == 8
    assert set(picks(temperature=1.0, top_k=2, samplers=("top_k",))) == {0, 1}
    # No temperature step: the logits as they are (temperature 5 unused).
    assert picks(temperature=5.0, samplers=("top_k",), top_k=3) == picks(temperature=1.0, top_k=3)
    # Rows of other orders in one batch each get their own chain.
    mixed = [SamplingParams(temperature=3.0, top_p=0.5, seed=i, samplers=("top_p", "temperature") if i % 2 else None)
             for i in range(200)]
    together = sampler(logits[:200], [Request(f"m{i}", [1], sp, max_tokens=4) for i, sp in enumerate(mixed)])
    alone = [sampler(logits[:1], [Request(f"a{i}", [1], sp, max_tokens=4)]).token_ids[0] for i, sp in enumerate(mixed)]
    assert together.token_ids == alone
    with pytest.raises(ValueError, match="samplers must list"):
        SamplingParams(samplers=("top_k", "dry"))


# --------------------------------------------------------------------------- mirostat


def test_mirostat_keeps_what_llama_cpp_keeps_and_moves_mu_as_it_does():
    rng = random.Random(5)
    checked = 0
    for trial in range(300):
        vocab = rng.choice([50, 300, 2000])
        # Zipf-like rows of varied steepness, some with masked (-inf) tokens.
        s = rng.uniform(0.6, 2.5)
        logits = torch.tensor([-s * math.log(i + 1) + rng.gauss(0, 0.3) for i in range(vocab)])
        logits = logits[torch.randperm(vocab, generator=torch.Generator().manual_seed(trial))]
        if trial % 3 == 0:
            logits[torch.tensor(rng.sample(range(vocab), vocab // 4))] = float("-inf")
        probs = logits.softmax(-1)
        for version in (1, 2):
            mu = rng.uniform(0.5, 12.0)
            out = apply_mirostat(probs.clone(), mu, version)
            kept = set(torch.nonzero(out).flatten().tolist())
            reference = llama_cpp_mirostat(probs.tolist(), mu, version)
            if len(reference) < vocab and abs(-math.log2(probs[reference[-1]]) - mu) < 1e-4:
                continue  # a token on the boundary itself: float32 against float64
            assert kept == set(reference), (trial, version, mu)
            assert torch.allclose(out.sum(), torch.tensor(1.0))
            assert torch.allclose(out[list(kept)], probs[list(kept)] / probs[list(kept)].sum())
            checked += 1
    assert checked > 550
    # The feedback: mu moves against the error of the sampled token's surprise (in bits).
    assert mirostat_update(6.0, 0.25, 5.0, 0.1) == pytest.approx(6.0 - 0.1 * (2.0 - 5.0))
    assert mirostat_update(6.0, 2 ** -9, 5.0, 0.5) == pytest.approx(6.0 - 0.5 * (9.0 - 5.0))


@pytest.mark.parametrize("version", [1, 2])
def test_mirostat_holds_the_answers_surprise_near_tau(version):
    # Flat-ish rows (about 9 bits of surprise a token without mirostat): mirostat's
    # feedback brings the sampled tokens' mean surprise to tau; without feedback (eta 0)
    # it stays far from it. A mistake in the update's sign or units would not converge.
    vocab, steps, tau = 2000, 600, 3.0
    gen = torch.Generator().manual_seed(version)
    sampler = Sampler(vocab)

    def mean_surprise(eta: float) -> float:
        request = Request("r", [1], SamplingParams(temperature=1.0, mirostat=version, mirostat_tau=tau,
                                                   mirostat_eta=eta, seed=9), max_tokens=steps)
        assert request.mirostat_mu == 2 * tau  # llama.cpp's start
        surprises = []
        for _ in range(steps):
            logits = -0.7 * torch.log(torch.arange(1, vocab + 1, dtype=torch.float32))
            logits = logits[torch.randperm(vocab, generator=gen)].unsqueeze(0)
            mu = request.mirostat_mu
            out = sampler(logits, [request])
            new_mu = out.mirostat_mu[0]
            assert new_mu is not None
            probs = apply_mirostat(logits[0].softmax(-1), mu, version)
            surprises.append(-math.log2(float(probs[out.token_ids[0]])))
            assert new_mu == pytest.approx(mirostat_update(mu, float(probs[out.token_ids[0]]), tau, eta))
            request.mirostat_mu = new_mu
        return sum(surprises[100:]) / len(surprises[100:])

    assert abs(mean_surprise(0.1) - tau) < 0.3
    assert abs(mean_surprise(0.0) - tau) > 1.0


def test_mirostat_replaces_the_truncations_and_only_its_temperature_makes_it_greedy():
    # top_k 1 and the truncations are llama.cpp's chain without mirostat: with it, unused.
    logits = torch.tensor([[2.0, 1.9, 1.8, 1.7, 1.6, 1.5, 1.4, 1.3]]).repeat(2000, 1)
    sampler = Sampler(8)
    sp = SamplingParams(temperature=1.0, top_k=1, top_p=0.1, min_p=0.9, typical_p=0.2, mirostat=2,
                        mirostat_tau=5.0)
    assert not sp.greedy
    requests = [Request(f"r{i}", [1], sp, max_tokens=4) for i in range(2000)]
    assert set(sampler(logits, requests).token_ids) == set(range(8))  # mu 10: every token kept
    cold = SamplingParams(temperature=0.0, mirostat=2)
    out = sampler(logits[:1], [Request("c", [1], cold, max_tokens=4)])
    assert out.token_ids == [0] and not any(out.mirostat_mu or [])  # mu only moves when sampling


# --------------------------------------------------------------------------- in the engine

BLOCK_SIZE = 16


def make_engine(loaded, num_blocks: int = 64, max_model_len: int = 512) -> LLMEngine:
    budget = num_blocks * kv_bytes_per_block(loaded.config, loaded.dtype, BLOCK_SIZE)
    return LLMEngine(EngineConfig(dtype="float32", device="cpu", kv_cache_memory=budget, block_size=BLOCK_SIZE,
                                  max_model_len=max_model_len, kv_cache_dtype="float32"), loaded=loaded)


def generate(engine: LLMEngine, prompts: list[list[int]], settings: list[SamplingParams]) -> list[tuple]:
    for i, (p, sp) in enumerate(zip(prompts, settings)):
        engine.add_request(f"q{i}", p, sp)
    got: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            o = out.outputs[0]
            g = got.setdefault(out.request_id, [[], []])
            g[0] += o.token_ids
            g[1] += [(lp.token_id, lp.logprob, lp.top) for lp in o.logprobs or []]
    assert engine.kv_cache.stats.num_blocks_used == 0
    return [tuple(map(tuple, got[f"q{i}"])) for i in range(len(prompts))]


@pytest.mark.slow
def test_dry_in_the_engine_is_the_reference_penalty_on_the_models_logits(smollm2_loaded):
    """Each greedy DRY token (and its logprobs) equals that step run without DRY but with
    the reference's penalties as a logit bias (the same float32 subtraction), the
    breakers found in the real vocabulary and the prompt part of the context."""
    tok = smollm2_loaded.tokenizer
    engine = make_engine(smollm2_loaded)
    prompt = tok.encode("Say it again and again: the cat sat on the mat. the cat sat on the mat. the cat sat")
    dry = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3, dry_multiplier=1.0,
                         dry_base=1.5, dry_allowed_length=2)
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    [(tokens, logprobs)] = generate(engine, [prompt], [dry])
    [(undamped, _)] = generate(engine, [prompt], [plain])
    assert tokens != undamped  # DRY changed the answer: the model repeats itself without it
    vocab = [tok.token_bytes(t) for t in range(engine.vocab_size)]
    breakers = dry_breakers(vocab, lambda s: tok.encode(s, add_special_tokens=False), dry.dry_sequence_breakers)
    newline = tok.encode("\n", add_special_tokens=False)[0]
    assert breakers[newline] == ((),)
    as_lists = {h: list(t) for h, t in breakers.items()}
    penalised = 0
    for step in range(len(tokens)):
        context = prompt + list(tokens[:step])
        penalties = llama_cpp_dry(context, 1.0, 1.5, 2, -1, as_lists)
        assert all(p <= 100 for p in penalties.values())  # a logit bias can say it
        penalised += bool(penalties)
        bias = {t: -p for t, p in penalties.items()}
        [(one, one_logprobs)] = generate(engine, [context], [SamplingParams(temperature=0, max_tokens=1,
                                                                             logprobs=3, logit_bias=bias)])
        assert one == (tokens[step],) and one_logprobs[0] == logprobs[step], step
    assert penalised >= len(tokens) // 3  # the prompt and the answer repeat: DRY was at work


@pytest.mark.slow
def test_seeded_requests_with_llama_cpps_samplers_are_the_same_alone_batched_and_preempted(smollm2_loaded):
    tok = smollm2_loaded.tokenizer
    prompts = [tok.encode(t) for t in ("Once upon a time, in a quiet village,", "The recipe for bread is simple:",
                                       "List three colours: red,", "My favourite animal is", "Dear diary, today",
                                       "The best way to learn is")]
    settings = [
        SamplingParams(temperature=1.0, seed=1, max_tokens=24, xtc_probability=0.5, xtc_threshold=0.1,
                       dry_multiplier=0.8),
        SamplingParams(temperature=0.8, seed=2, max_tokens=24, typical_p=0.7, top_n_sigma=1.5, logprobs=2,
                       dynatemp_range=0.5, min_p=0.05, temperature_last=True),
        SamplingParams(temperature=1.2, seed=3, max_tokens=24, xtc_probability=1.0, xtc_threshold=0.05,
                       top_k=40, top_p=0.9, min_p=0.05, typical_p=0.9, dry_multiplier=1.0, dry_penalty_last_n=32),
        # Mirostat's mu is the request's own state: it survives preemption (all 24 tokens, for
        # the checks below of what changes mu: an answer that ends at 4 tokens may not show it).
        SamplingParams(temperature=0.9, seed=4, max_tokens=24, mirostat=2, mirostat_tau=3.0, mirostat_eta=0.2,
                       logprobs=1, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=5, max_tokens=24, mirostat=1, mirostat_tau=4.0, top_k=40),
        # A chain of its own order, batched with the default order's rows.
        SamplingParams(temperature=1.3, seed=6, max_tokens=24, min_p=0.1, top_k=20, xtc_probability=0.5,
                       samplers=("min_p", "xtc", "temperature", "top_k")),
    ]
    alone = [generate(make_engine(smollm2_loaded), [p], [s])[0] for p, s in zip(prompts, settings)]
    assert generate(make_engine(smollm2_loaded), prompts, settings) == alone
    # A cache this small preempts: the requests re-run, their generators still in step.
    small = make_engine(smollm2_loaded, num_blocks=7, max_model_len=64)
    assert generate(small, prompts, settings) == alone
    assert small.scheduler.num_preemptions_total > 0
    # XTC's coin is drawn (from the request's generator) and changes what is sampled.
    without = settings[2].__class__(**{**settings[2].__dict__, "xtc_probability": 0.0})
    assert generate(make_engine(smollm2_loaded), [prompts[2]], [without])[0] != alone[2]
    # Mirostat (tau 3 bits, against the model's usual surprise) changes the answer too.
    plain = settings[3].__class__(**{**settings[3].__dict__, "mirostat": 0})
    assert generate(make_engine(smollm2_loaded), [prompts[3]], [plain])[0][0] != alone[3][0]
    # ... and its mu moves with each token the engine keeps (eta 0 would hold it at 2 * tau).
    fixed = settings[3].__class__(**{**settings[3].__dict__, "mirostat_eta": 0.0})
    assert generate(make_engine(smollm2_loaded), [prompts[3]], [fixed])[0][0] != alone[3][0]

"""Sampler: processors, masks, greedy/seeded sampling and logprobs, with exact expectations."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from engine.logits_processors import apply_logits_processors
from engine.request import Request
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.truncation import apply_min_p, apply_top_k_top_p

_ids = itertools.count()
NEG_INF = float("-inf")


def make_request(prompt: list[int] | None = None, output: list[int] | None = None,
                 eos: tuple[int, ...] = (), **params) -> Request:
    request = Request(request_id=f"r{next(_ids)}", prompt_token_ids=list(prompt or [0]),
                      sampling_params=SamplingParams(**params), max_tokens=16,
                      eos_token_ids=frozenset(eos))
    request.output_token_ids = list(output or [])
    return request


def logits_of(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def log_probs(*probs: float) -> list[float]:
    return [math.log(p) for p in probs]


# ----------------------------------------------------------------- processors

def test_logit_bias_is_added():
    request = make_request(logit_bias={2: 5.0, 0: -100.0})
    out = apply_logits_processors(logits_of([2.0, -1.0, 0.5, 3.0]), [request])
    assert out.tolist() == [[-98.0, -1.0, 5.5, 3.0]]


def test_allowed_token_ids_leave_only_those_tokens():
    # vLLM's allowed_token_ids: the rest -inf, the allowed ones as they were (then biased).
    out = apply_logits_processors(logits_of([2.0, -1.0, 0.5, 3.0], [2.0, -1.0, 0.5, 3.0]),
                                  [make_request(allowed_token_ids=[1, 2], logit_bias={2: 1.0}), make_request()])
    assert out.tolist() == [[NEG_INF, -1.0, 1.5, NEG_INF], [2.0, -1.0, 0.5, 3.0]]
    logits = torch.randn(200, 50, generator=torch.Generator().manual_seed(4))
    sampled = Sampler(50)(logits, [make_request(allowed_token_ids=[7, 9, 11], seed=i) for i in range(200)])
    assert set(sampled.token_ids) == {7, 9, 11}
    greedy = Sampler(50)(logits[:1], [make_request(temperature=0.0, allowed_token_ids=[7, 9, 11], logprobs=1)])
    best = max((7, 9, 11), key=lambda t: logits[0, t])
    assert greedy.token_ids == [best]
    # Its logprob is of the distribution over the allowed tokens alone.
    allowed = torch.log_softmax(logits[0, [7, 9, 11]], 0)
    assert greedy.logprobs[0].logprob == pytest.approx(allowed[(7, 9, 11).index(best)].item(), abs=1e-6)
    with pytest.raises(ValueError, match="allowed_token_ids must not be empty"):
        SamplingParams(allowed_token_ids=[])


def test_processors_do_not_modify_their_input():
    logits = logits_of([2.0, -1.0, 0.5, 3.0])
    apply_logits_processors(logits, [make_request(logit_bias={1: 1.0}, repetition_penalty=2.0)])
    assert logits.tolist() == [[2.0, -1.0, 0.5, 3.0]]


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    request = make_request(prompt=[0], output=[1, 3, 3], repetition_penalty=2.0)
    out = apply_logits_processors(logits_of([2.0, -1.0, 0.5, 3.0]), [request])
    assert out.tolist() == [[1.0, -2.0, 0.5, 1.5]]


def test_presence_and_frequency_penalties_count_output_tokens_only():
    request = make_request(prompt=[0], output=[1, 3, 3], presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_logits_processors(logits_of([2.0, -1.0, 0.5, 3.0]), [request])
    assert out.tolist() == [[2.0, -1.75, 0.5, 2.0]]


def test_processors_apply_per_row():
    plain = make_request(output=[1])
    penalised = make_request(output=[1], presence_penalty=1.0)
    out = apply_logits_processors(logits_of([1.0, 1.0], [1.0, 1.0]), [plain, penalised])
    assert out.tolist() == [[1.0, 1.0], [1.0, 0.0]]


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached():
    blocked = make_request(output=[0], eos=(3,), stop_token_ids=[1], min_tokens=2)
    reached = make_request(output=[0, 0], eos=(3,), stop_token_ids=[1], min_tokens=2)
    out = apply_logits_processors(logits_of([2.0, -1.0, 0.5, 3.0], [2.0, -1.0, 0.5, 3.0]), [blocked, reached])
    assert out.tolist() == [[2.0, NEG_INF, 0.5, NEG_INF], [2.0, -1.0, 0.5, 3.0]]


def test_min_tokens_blocks_eos_when_sampling():
    request = make_request(eos=(3,), min_tokens=1, temperature=0.0)
    assert Sampler(4)(logits_of([2.0, -1.0, 0.5, 3.0]), [request]).token_ids == [0]


def test_out_of_vocab_token_ids_are_ignored():
    request = make_request(prompt=[7], logit_bias={9: 1.0}, repetition_penalty=2.0)
    out = apply_logits_processors(logits_of([2.0, -1.0]), [request])
    assert out.tolist() == [[2.0, -1.0]]


# ----------------------------------------------------------------- masks

# Probabilities 0.15, 0.5, 0.05, 0.3: sorted, token 1 then 3, 0, 2.
SKEWED = log_probs(0.15, 0.5, 0.05, 0.3)


def kept(logits: torch.Tensor) -> list[list[int]]:
    return [[i for i, v in enumerate(row) if v != NEG_INF] for row in logits.tolist()]


def test_top_k_keeps_the_k_largest():
    out = apply_top_k_top_p(logits_of(SKEWED, SKEWED), torch.tensor([2, 3]), None)
    assert kept(out) == [[1, 3], [0, 1, 3]]


def test_top_k_keeps_values_tied_with_the_kth():
    out = apply_top_k_top_p(logits_of([1.0, 2.0, 1.0, 0.0]), torch.tensor([2]), None)
    assert kept(out) == [[0, 1, 2]]


def test_top_p_keeps_the_smallest_set_reaching_p():
    out = apply_top_k_top_p(logits_of(SKEWED, SKEWED, SKEWED), None, torch.tensor([0.7, 0.85, 0.3]))
    assert kept(out) == [[1, 3], [0, 1, 3], [1]]


def test_top_p_leaves_kept_logits_unchanged():
    out = apply_top_k_top_p(logits_of(SKEWED), None, torch.tensor([0.7]))
    assert out[0, 1].item() == logits_of(SKEWED)[0, 1].item()
    assert out[0, 3].item() == logits_of(SKEWED)[0, 3].item()


def test_top_p_one_keeps_everything():
    out = apply_top_k_top_p(logits_of(SKEWED), torch.tensor([4]), torch.tensor([1.0]))
    assert kept(out) == [[0, 1, 2, 3]]


def test_top_k_then_top_p_renormalises_within_top_k():
    # Within the top 2 the probabilities are 0.625 and 0.375: p = 0.6 keeps only token 1.
    out = apply_top_k_top_p(logits_of(SKEWED), torch.tensor([2]), torch.tensor([0.6]))
    assert kept(out) == [[1]]


def test_min_p_keeps_tokens_above_a_fraction_of_the_max():
    out = apply_min_p(logits_of(SKEWED, SKEWED), torch.tensor([0.5, 0.2]))
    assert kept(out) == [[1, 3], [0, 1, 3]]


# ----------------------------------------------------------------- sampling

def test_greedy_takes_the_argmax():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    requests = [make_request(temperature=0.0) for _ in range(3)]
    out = Sampler(50)(logits, requests)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None, None, None]


def test_top_k_one_equals_greedy():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    greedy = Sampler(50)(logits, [make_request(temperature=0.0) for _ in range(4)])
    top1 = Sampler(50)(logits, [make_request(temperature=1.5, top_k=1) for _ in range(4)])
    assert top1.token_ids == greedy.token_ids


def test_padded_vocab_columns_are_never_sampled():
    logits = logits_of([0.0, 1.0, 0.0, 9.0, 9.0])
    assert Sampler(3)(logits, [make_request(temperature=0.0)]).token_ids == [1]
    assert Sampler(3)(logits, [make_request(seed=3, top_p=0.5)]).token_ids == [1]


def test_random_sampling_stays_inside_the_mask():
    logits = logits_of(*[SKEWED] * 200)
    requests = [make_request(top_p=0.7) for _ in range(200)]
    tokens = Sampler(4)(logits, requests).token_ids
    assert set(tokens) == {1, 3}


def test_seeded_sampling_is_reproducible_alone_and_in_any_row():
    flat = torch.zeros(1, 1000)  # every token equally likely: the seed alone decides

    def draw(batch_size: int, row: int) -> list[int]:
        seeded = make_request(seed=1234)
        others = [make_request(seed=i) if i % 2 else make_request() for i in range(batch_size)]
        requests = others[:row] + [seeded] + others[row:]
        logits = flat.expand(len(requests), -1)
        return [Sampler(1000)(logits, requests).token_ids[row] for _ in range(5)]

    alone = draw(0, 0)
    assert draw(3, 2) == alone
    assert draw(5, 0) == alone
    assert len(set(alone)) > 1  # the generator advances between steps


def test_all_masked_rows_fall_back_to_the_raw_argmax():
    masked = [make_request(eos=(0, 1, 2), min_tokens=1, temperature=0.0),
              make_request(eos=(0, 1, 2), min_tokens=1, seed=0)]
    logits = logits_of([0.0, 2.0, 1.0], [0.0, 2.0, 1.0])
    assert Sampler(3)(logits, masked).token_ids == [1, 1]


def test_minus_inf_rows_do_not_break_sampling():
    logits = logits_of([NEG_INF, NEG_INF, NEG_INF], [NEG_INF, 0.0, NEG_INF])
    out = Sampler(3)(logits, [make_request(seed=0), make_request(seed=0, logprobs=0)])
    assert out.token_ids[1] == 1
    assert 0 <= out.token_ids[0] < 3


# ----------------------------------------------------------------- logprobs

def test_logprobs_are_log_softmax_with_top_k_best_first():
    logits = logits_of(SKEWED, SKEWED)
    requests = [make_request(temperature=0.0, logprobs=2), make_request(temperature=0.0)]
    out = Sampler(4)(logits, requests)
    expected = torch.log_softmax(logits[0], dim=-1)
    first = out.logprobs[0]
    assert (first.token_id, first.logprob) == (1, expected[1].item())
    assert first.top == [(1, expected[1].item()), (3, expected[3].item())]
    assert out.logprobs[1] is None


def test_logprobs_zero_gives_only_the_sampled_token():
    out = Sampler(4)(logits_of(SKEWED), [make_request(seed=5, logprobs=0)])
    logprob = out.logprobs[0]
    assert logprob.token_id == out.token_ids[0]
    assert logprob.logprob == torch.log_softmax(logits_of(SKEWED)[0], dim=-1)[logprob.token_id].item()
    assert logprob.top == []


def test_logprobs_follow_bias_but_not_temperature():
    request = make_request(temperature=0.5, top_k=2, logit_bias={2: 1.0}, logprobs=1, seed=0)
    logits = logits_of([2.0, -1.0, 0.5, 3.0])
    expected = torch.log_softmax(logits_of([2.0, -1.0, 1.5, 3.0])[0], dim=-1)
    out = Sampler(4)(logits, [request])
    assert out.logprobs[0].logprob == expected[out.token_ids[0]].item()
    assert out.logprobs[0].top == [(3, expected[3].item())]


def test_sampler_rejects_an_empty_vocabulary():
    with pytest.raises(ValueError, match="vocab_size"):
        Sampler(0)


def test_bad_words_mask_the_token_that_would_complete_one():
    # A one-token word is always masked; a two-token word's last token only after its first.
    one = make_request(output=[5])
    one.bad_words_token_ids = ((2,), (1, 3))
    after = make_request(output=[4, 1])
    after.bad_words_token_ids = ((1, 3),)
    out = apply_logits_processors(logits_of(*[[2.0, -1.0, 0.5, 3.0]] * 2), [one, after])
    assert out.tolist() == [[2.0, -1.0, NEG_INF, 3.0], [2.0, -1.0, 0.5, NEG_INF]]
    with pytest.raises(ValueError, match="bad_words must not hold an empty word"):
        SamplingParams(bad_words=[""])

"""engine.validation.check_request: the one check a request passes on its way in."""

from __future__ import annotations

import pytest

from engine.sampling_params import SamplingParams, StructuredOutput, ThinkTokens
from engine.validation import InvalidRequestError, RequestLimits, check_request

LIMITS = RequestLimits(vocab_size=100, max_model_len=64)


def refusal(prompt: list[int], **params) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as excinfo:
        check_request(prompt, SamplingParams(**params), LIMITS)
    return excinfo.value


def test_a_request_that_fits_resolves_max_tokens() -> None:
    assert check_request([1, 2, 3], SamplingParams(max_tokens=61), LIMITS) == 61
    # None means the rest of the context.
    assert check_request([1, 2, 3], SamplingParams(max_tokens=None), LIMITS) == 61


def test_an_empty_prompt_is_refused() -> None:
    err = refusal([])
    assert err.param == "prompt" and "empty" in str(err)


@pytest.mark.parametrize("bad", [-1, 100])
def test_prompt_ids_outside_the_vocabulary_are_refused(bad: int) -> None:
    err = refusal([1, bad])
    assert err.param == "prompt"
    assert f"token id {bad}," in str(err) and "[0, 100)" in str(err)


@pytest.mark.parametrize("field, params", [
    ("stop_token_ids", {"stop_token_ids": [5, 100]}),
    ("logit_bias", {"logit_bias": {100: 1.0}}),
])
def test_parameter_ids_outside_the_vocabulary_name_their_parameter(field: str, params: dict) -> None:
    err = refusal([1], **params)
    assert err.param == field and "token id 100" in str(err)


def test_prompt_plus_max_tokens_over_the_context_names_every_number() -> None:
    err = refusal([7] * 50, max_tokens=20)
    assert err.param == "prompt"
    assert "64 tokens" in str(err) and "70 tokens (50 in the prompt, 20 for the completion)" in str(err)
    assert check_request([7] * 50, SamplingParams(max_tokens=14), LIMITS) == 14


def test_a_prompt_that_fills_the_context_leaves_no_room() -> None:
    err = refusal([7] * 64, max_tokens=None)
    assert err.param == "prompt" and "your prompt has 64 tokens" in str(err)


def test_the_refusal_is_a_value_error() -> None:
    # Callers outside the server (offline generate, tests) catch ValueError.
    assert issubclass(InvalidRequestError, ValueError)


def test_min_tokens_past_the_context_is_refused() -> None:
    # Without max_tokens the completion may take the rest of the context (61 tokens here).
    err = refusal([1, 2, 3], max_tokens=None, min_tokens=62)
    assert err.param == "min_tokens" and "61" in str(err) and "62" in str(err)
    err = refusal([1, 2, 3], max_tokens=None, min_tokens=2**63)
    assert err.param == "min_tokens"
    assert check_request([1, 2, 3], SamplingParams(max_tokens=None, min_tokens=61), LIMITS) == 61


def test_think_tokens_are_checked_and_need_a_structured_output() -> None:
    regex = StructuredOutput("regex", "[0-9]+")
    err = refusal([1, 2], structured=regex, think=ThinkTokens(5, 100))
    assert err.param == "think" and "100" in str(err)
    assert check_request([1, 2], SamplingParams(max_tokens=4, structured=regex, think=ThinkTokens(5, 6)),
                         LIMITS) == 4
    with pytest.raises(ValueError, match="think only shapes a structured output"):
        SamplingParams(think=ThinkTokens(5, 6))


def test_a_priority_needs_the_priority_policy() -> None:
    err = refusal([1, 2], priority=1)
    assert err.param == "priority" and "--scheduling-policy priority" in str(err)
    assert check_request([1, 2], SamplingParams(max_tokens=4, priority=0), LIMITS) == 4
    with_policy = RequestLimits(vocab_size=100, max_model_len=64, priority_scheduling=True)
    for priority in (-3, 1, 10**6):
        assert check_request([1, 2], SamplingParams(max_tokens=4, priority=priority), with_policy) == 4
    with pytest.raises(ValueError, match="priority must be an integer"):
        SamplingParams(priority=1.5)  # type: ignore[arg-type]

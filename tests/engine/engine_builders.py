"""Builders shared by the block-manager and scheduler tests (imported by module name,
as pytest puts this folder on sys.path)."""

from __future__ import annotations

from collections.abc import Sequence

from engine.request import Request
from engine.sampling_params import SamplingParams


def make_request(request_id: str, prompt_token_ids: Sequence[int], max_tokens: int = 16,
                 eos_token_ids: Sequence[int] = ()) -> Request:
    """A greedy request; EOS never matches unless ``eos_token_ids`` is given."""
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt_token_ids),
        sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0),
        max_tokens=max_tokens,
        eos_token_ids=frozenset(eos_token_ids),
    )

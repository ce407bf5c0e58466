"""What the engine hands back to its callers, one delta per step per request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """Log-probability of one generated token, with the top alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first
    rank: int | None = None  # among the whole vocabulary, 1 = most likely (prompt logprobs only)


@dataclass
class CompletionOutput:
    """The new part of one of a request's ``n`` samples since the last delta."""

    index: int
    text: str  # new text only (a delta), UTF-8 complete, stop strings held back
    token_ids: list[int]  # new token ids only
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    # On a sample's first delta, when ``prompt_logprobs`` was asked for: one entry per
    # prompt token (its logprob given the tokens before it), the first None.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # An embedding request's answer (``SamplingParams.pooling``), on its only delta.
    embedding: list[float] | None = None


@dataclass
class RequestOutput:
    """One delta for one request: the outputs that changed in this step.

    ``finished`` is True on the last delta of the request (every sample done).
    ``num_cached_tokens`` counts prompt tokens served from the prefix cache.
    ``error`` is set when the engine failed the request (an engine fault).
    """

    request_id: str
    outputs: list[CompletionOutput]
    prompt_token_ids: list[int]
    finished: bool = False
    num_cached_tokens: int = 0
    error: str | None = None

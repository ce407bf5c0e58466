"""Numbers the engine reports after every step, for metrics and logs.

The engine fills these; the server turns them into Prometheus series. Keeping
the derivation here means the HTTP layer never recomputes engine state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class FinishedRequestStats:
    """One sequence's life, reported once when it finishes."""

    finish_reason: str  # "stop" | "length" | "abort"
    num_prompt_tokens: int
    num_generation_tokens: int
    e2e_latency: float  # seconds from arrival to finish
    queue_time: float  # seconds from arrival to first scheduled (0 if never scheduled)
    # Seconds, None where the sequence never got that far (never scheduled, no token):
    inference_time: float | None = None  # first scheduled to finish
    prefill_time: float | None = None  # first scheduled to first token
    decode_time: float | None = None  # first token to last


@dataclass
class StructuredRequestStats:
    """One engine request (a prompt) with a structured output, reported when it enters the engine."""

    kind: str  # engine.sampling_params.STRUCTURED_KINDS
    compile_seconds: float  # checking and compiling its grammar


@dataclass
class StepStats:
    """What happened in one engine step, plus the engine's state after it.

    Token counters are deltas for this step, so summing them over steps gives
    exact totals. ``num_prompt_tokens`` counts each API request's prompt once,
    when its first token is produced (so it equals the ``usage.prompt_tokens``
    of responses), and ``num_generation_tokens`` counts sampled tokens.
    """

    # Gauges (state after the step).
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_usage: float = 0.0
    # Sequences running and waiting per LoRA adapter (only adapters with any; none
    # when the engine serves no adapter).
    lora_running: dict[str, int] = field(default_factory=dict)
    lora_waiting: dict[str, int] = field(default_factory=dict)
    # Deltas for this step.
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_batched_tokens: int = 0  # tokens run through the model this step
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of which found
    num_preemptions: int = 0
    time_to_first_token: list[float] = field(default_factory=list)
    inter_token_latency: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    structured: list[StructuredRequestStats] = field(default_factory=list)
    # Speculative decoding: requests that ran proposals, the proposed tokens,
    # the accepted ones, and accepted counts by position (0 = first proposal).
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: dict[int, int] = field(default_factory=dict)
    # A mixture of experts with --expert-routing-metrics: tokens each sparse layer routed
    # to each expert this step, by layer index (a list over the experts).
    routed_tokens: dict[int, list[int]] = field(default_factory=dict)


class StatLogger(Protocol):
    """Receives each step's stats. Called on the engine thread: keep it quick."""

    def record(self, stats: StepStats) -> None: ...

"""One sequence's state inside the engine (one of a request's ``n`` samples)."""

from __future__ import annotations

import enum
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.outputs import TokenLogprob
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.structured import CompiledGrammar, Grammar
    from models.lora import LoRAAdapter


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI finish_reason for a finished status (None while running)."""
        return self.value if self.finished else None


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
}


@dataclass(frozen=True)
class EngineRequest:
    """A request that passed ``engine.validation.check_request``, on its way into the engine."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: never None
    arrival_time: float
    group: str  # admission takes turns between groups (engine/waiting_queue.py)
    grammar: CompiledGrammar | None = None  # params.structured, compiled (engine/structured.py)
    adapter: str | None = None  # the LoRA adapter the request runs, by its key (None: the base model)
    # Its weights, held from the check on: an adapter unloaded before the request enters
    # the engine still serves it (the unload comes after it, as far as it is concerned).
    lora: LoRAAdapter | None = None
    # ``params.bad_words`` as token sequences (Request.bad_words_token_ids), tokenized in the check.
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # ``params.dry_sequence_breakers`` as tokens (Request.dry_breakers), found in the check.
    dry_breakers: Mapping[int, tuple[tuple[int, ...], ...]] = field(default_factory=dict)


@dataclass
class Request:
    """A single sequence: prompt, generated tokens and scheduling progress.

    The scheduler owns ``status`` and ``num_computed_tokens``; the KV cache
    manager owns the sequence's blocks (keyed by ``request_id``). ``max_tokens``
    is resolved (never None) when the request is created.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    # Requests of one group take turns with other groups for admission
    # (engine/waiting_queue.py); empty means a group of its own.
    group: str = ""
    sample_index: int = 0
    # The LoRA adapter its tokens run (None: the base model). Its KV differs from the
    # base model's, so it is part of the prefix cache's key.
    adapter: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    num_preemptions: int = 0
    stop_reason: str | int | None = None
    # Why the engine failed this sample (then it is FINISHED_ABORTED): a grammar fault.
    error: str | None = None
    generator: torch.Generator | None = None
    # With mirostat: its mu, the surprise bound for the next token (engine.sampler.apply_mirostat),
    # moved after each sampled token; kept through preemption like the output itself.
    mirostat_mu: float | None = None
    # The sample's structured-output matcher, fed every appended token.
    grammar: Grammar | None = None
    # ``sampling_params.bad_words`` as token sequences (each word, and with a space before it).
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # With DRY on: ``sampling_params.dry_sequence_breakers`` as tokens (engine.sampler.dry_breakers).
    dry_breakers: Mapping[int, tuple[tuple[int, ...], ...]] = field(default_factory=dict)
    # Proposed next tokens for the coming step (engine.speculative); the scheduler
    # runs them after the last known token and the engine keeps what the model confirms.
    spec_token_ids: list[int] = field(default_factory=list)
    # With ``sampling_params.prompt_logprobs``: entry i is prompt token i's logprob
    # given the tokens before it (entry 0, which has none, is None), filled in as
    # the prompt's chunks run; None when not asked for.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # Timestamps (time.monotonic) for latency metrics.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    def __post_init__(self) -> None:
        assert self.max_tokens >= 1
        self.group = self.group or self.request_id
        seed = self.sampling_params.seed
        if seed is not None and self.generator is None:
            # Each of n samples gets its own stream, derived from the seed.
            self.generator = torch.Generator().manual_seed((seed + self.sample_index) % 2**63)
        if self.sampling_params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]
        if self.sampling_params.mirostat and self.mirostat_mu is None:
            self.mirostat_mu = 2 * self.sampling_params.mirostat_tau  # llama.cpp's start

    @property
    def needs_prompt_logits(self) -> bool:
        """Whether prompt positions' logits are still wanted (prompt logprobs not complete).

        Entry ``i + 1`` of ``prompt_logprobs`` comes from position ``i``'s logits,
        so the next position wanted is ``len(prompt_logprobs) - 1``.
        """
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def priority(self) -> int:
        """Its scheduling priority (lower first; 0 unless the engine's policy is priority)."""
        return self.sampling_params.priority

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: what the KV cache must eventually hold."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int, now: float | None = None) -> None:
        """Record one sampled token and its timestamp."""
        now = time.monotonic() if now is None else now
        if self.grammar is not None:
            self.grammar.advance(token_id)  # first: on a GrammarError the token is not recorded
        self.output_token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """Token-level stop after the last append: EOS, stop ids, a finished grammar, length.

        Stop *strings* are found by the detokenizer, not here.
        """
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                self.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if self.grammar is not None and self.grammar.finished:
            # The grammar accepts nothing more: the structured output is complete.
            self.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

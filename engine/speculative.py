"""Speculative decoding: proposals, and when to make them.

A decode step reads every weight for one token per sequence, so on a CPU a
step is bound by memory bandwidth and verifying a few more tokens of the same
sequence costs little more than decoding one. Two proposers guess the next
tokens of a sequence: ``NgramProposer`` from its own history (prompt lookup:
when its last ``n`` tokens, ``ngram_max`` down to ``ngram_min``, occurred
before, the tokens that followed that occurrence), and
``engine.draft.DraftProposer`` from a smaller model. The scheduler runs them as extra
positions of the request (``ScheduledRequest.spec_token_ids``); the engine
samples each of those positions as its own step would (``LLMEngine._verify``)
and keeps the proposals that equal what it sampled, plus the token after the
last one kept, so the output is the same as without speculation (in
distribution, and token for token when greedy or seeded).

``Speculator`` decides per step and per request: not when the step's batch
holds more than ``max_batch`` decodes (past that the step is compute-bound on
a small CPU and a rejected proposal costs real work; docs/performance.md has
the measurements), and not for a request whose recent proposals were mostly
rejected (``min_acceptance``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from engine.config import SpeculativeConfig
from engine.request import Request


class NgramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the
    sequence's last n tokens, for the longest n in [ngram_min, ngram_max] that occurs.

    A scan of the whole sequence per call: the definition, which ``NgramIndex``
    (what the engine uses) must agree with.
    """

    def __init__(self, ngram_min: int, ngram_max: int, num_tokens: int) -> None:
        self.ngram_min, self.ngram_max, self.num_tokens = ngram_min, ngram_max, num_tokens

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """Up to ``min(limit, num_tokens)`` proposed continuations of ``tokens``."""
        k = min(limit, self.num_tokens)
        if k <= 0:
            return []
        size = len(tokens)
        for n in range(min(self.ngram_max, size - 1), self.ngram_min - 1, -1):
            tail = tokens[size - n:]
            # The latest occurrence before the tail itself that has a continuation.
            for start in range(size - n - 1, -1, -1):
                if tokens[start:start + n] == tail:
                    return tokens[start + n:start + n + k]
        return []


class NgramIndex(NgramProposer):
    """``NgramProposer`` for one growing sequence, in time independent of its length:
    every n-gram maps to where its latest occurrence's continuation starts, updated
    with the tokens appended since the last call (a sequence only grows)."""

    def __init__(self, ngram_min: int, ngram_max: int, num_tokens: int) -> None:
        super().__init__(ngram_min, ngram_max, num_tokens)
        self._next: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # continuation starts [0, _indexed) are in _next

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        size = len(tokens)
        # Index the n-grams whose continuation start is now known: starts < size.
        for cont in range(max(self._indexed, 1), size):
            for n in range(self.ngram_min, min(self.ngram_max, cont) + 1):
                self._next[tuple(tokens[cont - n:cont])] = cont
        self._indexed = max(self._indexed, size)
        k = min(limit, self.num_tokens)
        if k <= 0:
            return []
        for n in range(min(self.ngram_max, size - 1), self.ngram_min - 1, -1):
            cont = self._next.get(tuple(tokens[size - n:]))
            if cont is not None:
                return tokens[cont:cont + k]
        return []


class Proposer(Protocol):
    """Where proposals come from: many requests at once, each forgotten when it ends."""

    def propose(self, requests: list[tuple[str, list[int], int]]) -> list[list[int]]:
        """For each ``(request id, its tokens so far, limit)``: at most ``limit`` proposed next tokens."""

    def forget(self, request_id: str) -> None:
        """Drop what is kept for a request that ended."""


class NgramProposals:
    """Prompt lookup for every request: one ``NgramIndex`` each."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._indexes: dict[str, NgramIndex] = {}

    def propose(self, requests: list[tuple[str, list[int], int]]) -> list[list[int]]:
        out = []
        for request_id, tokens, limit in requests:
            index = self._indexes.get(request_id)
            if index is None:
                c = self.config
                index = self._indexes[request_id] = NgramIndex(c.ngram_min, c.ngram_max, c.num_speculative_tokens)
            out.append(index.propose(tokens, limit))
        return out

    def forget(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)


@dataclass
class _Tracked:
    """One request's recent acceptance."""

    proposed: int = 0
    accepted: int = 0
    paused_until: int = 0


@dataclass
class Speculator:
    """Sets each running request's ``spec_token_ids`` before a step (from ``proposer``),
    and learns from what was accepted."""

    config: SpeculativeConfig
    max_model_len: int
    proposer: Proposer
    _tracked: dict[str, _Tracked] = field(default_factory=dict)
    _step: int = 0

    # Judge a request's acceptance over windows of this many proposed tokens.
    WINDOW_TOKENS = 16
    PAUSE_STEPS = 32

    def _state(self, request_id: str) -> _Tracked:
        state = self._tracked.get(request_id)
        if state is None:
            state = self._tracked[request_id] = _Tracked()
        return state

    def propose(self, running: list[Request]) -> None:
        """Give every running request its proposals for the next step (or none)."""
        self._step += 1
        decoding = [r for r in running if r.num_computed_tokens == r.num_tokens - 1]
        for r in running:
            r.spec_token_ids = []
        if len(decoding) > self.config.max_batch:
            return
        asked: list[tuple[Request, int]] = []
        for r in decoding:
            if r.sampling_params.mirostat:
                # Mirostat's mu after each proposal would depend on the distribution
                # at the one before it; such a request runs a token a step.
                continue
            # Never past max_tokens or the context: those tokens could not be kept.
            limit = min(r.max_tokens - r.num_output_tokens - 1, self.max_model_len - r.num_tokens)
            if limit > 0 and self._state(r.request_id).paused_until <= self._step:
                asked.append((r, limit))
        proposals = self.proposer.propose([(r.request_id, r.all_token_ids, limit) for r, limit in asked])
        for (r, _), spec in zip(asked, proposals):
            if spec and r.grammar is not None:
                # Only what the grammar could accept: the masks follow the proposals.
                spec = spec[:r.grammar.valid_prefix(spec)]
            r.spec_token_ids = spec

    def record(self, request: Request, proposed: int, accepted: int) -> None:
        """``accepted`` of the request's ``proposed`` tokens were kept this step."""
        state = self._state(request.request_id)
        state.proposed += proposed
        state.accepted += accepted
        if state.proposed >= self.WINDOW_TOKENS:
            if state.accepted < self.config.min_acceptance * state.proposed:
                state.paused_until = self._step + self.PAUSE_STEPS
            state.proposed = state.accepted = 0

    def forget(self, request_id: str) -> None:
        """The request finished: drop its proposer state and acceptance record."""
        self._tracked.pop(request_id, None)
        self.proposer.forget(request_id)

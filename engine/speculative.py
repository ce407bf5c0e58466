"""Speculative decoding: proposals, and when to make them.

A decode step reads every weight for one token per sequence, so on a CPU a
step is bound by memory bandwidth and verifying a few more tokens of the same
sequence costs little more than decoding one. Two proposers guess the next
tokens of a sequence: ``NgramProposer`` from its own history (prompt lookup:
when its last ``n`` tokens, ``ngram_max`` down to ``ngram_min``, occurred
before, the tokens that followed that occurrence), and
``engine.draft.DraftProposer`` from a smaller model. The scheduler runs them as extra
positions of the request (``ScheduledRequest.spec_token_ids``); the engine
samples each of those positions as its own step would (``sample_proposals``)
and keeps the proposals that equal what it sampled, plus the token after the
last one kept (``verify``), so the output is the same as without speculation
(in distribution, and token for token when greedy or seeded).

``Speculator`` decides per step and per request: not when the step's batch
holds more than ``max_batch`` decodes (past that the step is compute-bound on
a small CPU and a rejected proposal costs real work; docs/performance.md has
the measurements), and not for a request whose recent proposals were mostly
rejected (``min_acceptance``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.config import SpeculativeConfig
from engine.outputs import TokenLogprob
from engine.request import Request
from engine.sampler import Sampler
from engine.scheduler import ScheduledRequest
from engine.stats import StepStats


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


# -- verification ------------------------------------------------------------


@dataclass
class Proposed:
    """What the model picked after each of a request's proposals, and its generator's
    state before those picks (None: not seeded)."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    generator_state: torch.Tensor | None


def proposal_rows(items: list[ScheduledRequest]) -> tuple[list[int], dict[str, list[int]]]:
    """The logits rows of each request's last known token, and of each request's proposals
    (by request id; only requests with proposals)."""
    main: list[int] = []
    extra: dict[str, list[int]] = {}
    row = 0
    for item in items:
        main.append(row)
        k = len(item.spec_token_ids)
        if k:
            extra[item.request.request_id] = list(range(row + 1, row + 1 + k))
        row += 1 + k
    return main, extra


def sample_proposals(sampler: Sampler, logits: torch.Tensor, items: list[ScheduledRequest],
                     extra: dict[str, list[int]], masks: dict[str, torch.Tensor]) -> dict[str, Proposed]:
    """Sample the row after each proposal (``extra``, from :func:`proposal_rows`) as the
    request's next steps would: its own sampling settings and logits processors with the
    proposals before it as output, its grammar's mask after them (``masks``, by request id),
    and for a seeded request the next draws of its generator (whose state is kept, to be
    wound back to what the kept tokens used). Call it after sampling the rows of the last
    known tokens: each request's noise comes in order."""
    if not extra:
        return {}
    rows: list[int] = []
    requests: list[Request] = []
    states: dict[str, torch.Tensor | None] = {}
    masked_rows: list[int] = []
    for item in items:
        rid = item.request.request_id
        if rid in extra:
            if rid in masks:
                masked_rows += range(len(rows), len(rows) + len(extra[rid]))
            rows += extra[rid]
            # The logits processors (penalties, min_tokens) see the proposals before
            # each position as output, as that position's own step would.
            spec = item.spec_token_ids
            requests += [dataclasses.replace(item.request, output_token_ids=item.request.output_token_ids + spec[:j])
                         for j in range(1, len(spec) + 1)]
            states[rid] = item.request.generator.get_state() if item.request.generator is not None else None
    grammar_masks = None
    if masked_rows:
        grammar_masks = (masked_rows, torch.cat([masks[rid] for rid in states if rid in masks]))
    out = sampler(logits[rows], requests, grammar_masks)
    proposed: dict[str, Proposed] = {}
    start = 0
    for rid, state in states.items():
        k = len(extra[rid])
        proposed[rid] = Proposed(out.token_ids[start:start + k], out.logprobs[start:start + k], state)
        start += k
    return proposed


def verify(item: ScheduledRequest, token: int, logprob: TokenLogprob | None, proposed: Proposed | None,
           sampler: Sampler, speculator: Speculator | None, stats: StepStats
           ) -> tuple[list[int], list[TokenLogprob | None]]:
    """The tokens a request keeps and their logprobs: the sampled ``token`` and, while each
    proposal equals the model's own pick at its position, the pick after it (a request
    without proposals keeps ``token`` alone).

    Exact in distribution (and token for token for a seeded request): each kept
    token is what sampling that position alone would give. For a proposal this
    accepts it with the model's probability of it and otherwise samples from the
    rest, as rejection sampling against a one-token draft does. The acceptance goes
    to ``stats`` and to ``speculator``, which learns from it."""
    spec = item.spec_token_ids
    if not spec:
        return [token], [logprob]
    assert proposed is not None and len(proposed.token_ids) == len(spec)
    picks = [token] + proposed.token_ids
    accepted = 0
    while accepted < len(spec) and spec[accepted] == picks[accepted]:
        accepted += 1
    request = item.request
    if proposed.generator_state is not None and accepted < len(spec):
        # The rows past the last kept token drew noise that was never used.
        sampler.replay_noise(request, proposed.generator_state, accepted)
    stats.spec_drafts += 1
    stats.spec_draft_tokens += len(spec)
    stats.spec_accepted_tokens += accepted
    for position in range(accepted):
        stats.spec_accepted_per_position[position] = stats.spec_accepted_per_position.get(position, 0) + 1
    assert speculator is not None
    speculator.record(request, len(spec), accepted)
    return picks[:accepted + 1], ([logprob] + proposed.logprobs)[:accepted + 1]

"""Continuous batching: which requests run which tokens in the next step.

One token-budget loop, as in vLLM v1: there is no separate prefill or decode
phase. Each scheduled request catches its computed tokens up towards
``request.num_tokens`` within the step's budget, so a long prompt is split
across steps (chunked prefill) while running requests keep decoding. Running
requests go first, then admissions from the waiting queue. When blocks run
out, the last running request is preempted by recompute: its blocks are
freed and it later re-runs its prompt and the tokens it already generated
(mostly prefix-cache hits when its blocks were not evicted meanwhile).

Running requests are kept in admission order within each priority, the lowest
values first (vLLM's priority policy; every priority is 0 without it), so the
last one, the victim, is the newest of the lowest priority, and the most
urgent requests take the step's budget first.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.structured import GrammarError
from engine.waiting_queue import WaitingQueue
from models.kv_cache import cdiv


@dataclass
class SchedulerConfig:
    """Limits on one step and on a request's length."""

    max_model_len: int
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # Off means a prompt runs whole in one step, so the budget must hold the
    # longest request.
    enable_chunked_prefill: bool = True
    # At most this many LoRA adapters have requests running at once (None: any number):
    # a waiting request of another adapter waits, the ones behind it go ahead.
    max_loras: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "max_loras"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be at least max_model_len ({self.max_model_len}); raise it or enable "
                "chunked prefill")


@dataclass
class ScheduledRequest:
    """One request's share of a step."""

    request: Request
    start_pos: int  # request.num_computed_tokens before this step
    num_new_tokens: int  # all_token_ids[start_pos:start_pos + num_new_tokens] run this step
    block_tables: list[list[int]]  # the request's whole block tables after allocation (one per group)
    sample: bool  # the step reaches the last known token: sample the next one
    # Proposed tokens run after the last known one (the last of num_new_tokens);
    # each of their positions is sampled too, to verify them.
    spec_token_ids: list[int] = field(default_factory=list)
    # Prompt logprobs: the logits of this many prompt positions are wanted too, the
    # ones right before the sampled rows (or the chunk's last ones when it samples nothing).
    num_prompt_logits: int = 0
    # An embedding request's last prompt chunk: its last row's hidden state is its answer
    # (``sample`` is then False: nothing is sampled, and it finishes with this step).
    pool: bool = False

    @property
    def num_logits(self) -> int:
        """Logits rows this request gets back: its prompt positions' wanted ones, then
        the last known token's and each proposal's when it samples."""
        return self.num_prompt_logits + (1 + len(self.spec_token_ids) if self.sample else 0)

    @property
    def token_ids(self) -> list[int]:
        """The tokens this request runs this step."""
        known = self.num_new_tokens - len(self.spec_token_ids)
        return self.request.all_token_ids[self.start_pos:self.start_pos + known] + self.spec_token_ids


@dataclass
class SchedulerOutput:
    """What the model runs in one step (running requests first, then admissions)."""

    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    preempted: list[str] = field(default_factory=list)  # ids preempted this step
    admitted: list[str] = field(default_factory=list)  # ids admitted (or resumed) this step


class Scheduler:
    """Waiting and running queues, the per-step token budget and preemption.

    Single-threaded: call :meth:`finish_request` / :meth:`abort_request` between
    steps (not between :meth:`schedule` and :meth:`update_from_output`), since
    the blocks of a scheduled request are registered in the prefix cache before
    the model has written them.
    """

    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting = WaitingQueue()
        self.running: list[Request] = []
        self._requests: dict[str, Request] = {}  # every unfinished request
        self.num_preemptions_total = 0

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        """True while any request waits or runs."""
        return bool(self._requests)

    def add_request(self, request: Request) -> None:
        """Queue a request that ``engine.validation.check_request`` accepted."""
        rid = request.request_id
        assert rid not in self._requests, f"request id {rid!r} is already in use"
        assert request.num_prompt_tokens > 0, f"request {rid!r} has an empty prompt"
        # An embedding generates nothing: its prompt is all it holds.
        generated = request.max_tokens if request.sampling_params.pooling is None else 0
        longest = request.num_prompt_tokens + generated
        assert longest <= self.config.max_model_len, (rid, longest, self.config.max_model_len)
        # The engine sizes the cache for one max_model_len sequence, so this holds too.
        assert cdiv(longest, self.kv_cache.block_size) <= self.kv_cache.num_blocks, (rid, longest)
        request.status = RequestStatus.WAITING
        self._requests[rid] = request
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        """Pick the tokens of the next step and allocate their KV slots."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []

        # Running requests, oldest first; each takes what it needs up to the budget.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            assert num_new > 0, f"running request {request.request_id} has nothing to compute"
            # Proposals ride along while they fit the budget and the free blocks;
            # they never preempt anyone.
            spec = request.spec_token_ids[:budget - num_new] if request.num_tokens - request.num_computed_tokens == 1 else []
            if spec and not self.kv_cache.allocate_slots(request, num_new, num_lookahead=len(spec)):
                spec = []
            if not spec and not self._allocate_or_preempt(request, num_new, preempted):
                break  # it preempted itself: it was the newest
            request.spec_token_ids = spec
            scheduled.append(self._scheduled(request, num_new, spec))
            budget -= num_new + len(spec)
            i += 1

        # Admissions in the waiting queue's fair order (preempted requests first).
        # Not after a preemption: blocks are short, and admitting would only thrash.
        admitted: list[str] = []
        adapters, allowed = self._lora_limit()
        while (self.waiting and budget > 0 and not preempted
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting.peek(allowed)
            if request is None:
                break
            keep = None
            if request.needs_prompt_logits:
                # Prompt logprobs need the logits of the positions not scored yet: no
                # hit past them (none at all at first; after a preemption, what was scored).
                assert request.prompt_logprobs is not None
                keep = (len(request.prompt_logprobs) - 1) // self.kv_cache.block_size
            computed_blocks, num_cached = self.kv_cache.get_computed_blocks(request, keep)
            num_remaining = request.num_tokens - num_cached
            num_new = min(num_remaining, budget)
            if not self.config.enable_chunked_prefill and num_new < num_remaining:
                break
            if not self.kv_cache.allocate_slots(request, num_new, computed_blocks):
                break
            self.waiting.pop(request)
            if adapters is not None and request.adapter is not None:
                adapters.add(request.adapter)
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self._add_running(request)
            admitted.append(request.request_id)
            scheduled.append(self._scheduled(request, num_new))
            budget -= num_new

        return SchedulerOutput(
            scheduled=scheduled,
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            preempted=preempted,
            admitted=admitted,
        )

    def _add_running(self, request: Request) -> None:
        """Behind the running requests of its priority and of every more urgent one.

        Admissions come after this step's running loop, so a request placed before
        others is not skipped this step (it is scheduled as an admission)."""
        at = len(self.running)
        while at and self.running[at - 1].priority > request.priority:
            at -= 1
        self.running.insert(at, request)

    def _lora_limit(self) -> tuple[set[str] | None, Callable[[Request], bool] | None]:
        """Under ``max_loras``: the adapters with running requests (admissions add theirs)
        and which waiting requests may be admitted: the base model's, and an adapter's
        while it runs or while fewer than ``max_loras`` adapters do. ``(None, None)``
        without a limit."""
        limit = self.config.max_loras
        if limit is None:
            return None, None
        adapters = {r.adapter for r in self.running if r.adapter is not None}
        return adapters, lambda r: r.adapter is None or r.adapter in adapters or len(adapters) < limit

    def update_from_output(self, output: SchedulerOutput,
                           sampled: dict[str, list[int]]) -> list[tuple[Request, int]]:
        """Apply a finished step: advance progress, append sampled tokens, retire finished requests.

        ``sampled`` maps request id -> the tokens to append for every scheduled
        request with ``sample=True``: one, or after proposals the accepted ones
        (a prefix of ``spec_token_ids``) and the model's next token. Tokens are
        appended one at a time, stopping at the first that ends the request.
        Returns the requests that received tokens (finished or not) with how many.
        """
        now = time.monotonic()
        received: list[tuple[Request, int]] = []
        finished: set[str] = set()
        for item in output.scheduled:
            request = item.request
            if request.is_finished:  # finished from outside since schedule()
                continue
            assert request.num_computed_tokens == item.start_pos, "steps applied out of order"
            spec = item.spec_token_ids
            request.num_computed_tokens += item.num_new_tokens - len(spec)
            request.spec_token_ids = []
            if not item.sample:
                continue
            tokens = sampled.get(request.request_id)
            assert tokens, f"no sampled token for {request.request_id}"
            accepted = len(tokens) - 1
            assert tokens[:accepted] == spec[:accepted], "only confirmed proposals are kept"
            # The accepted proposals' K/V were written by this step's forward.
            request.num_computed_tokens += accepted
            status, count = None, 0
            for token in tokens:
                try:
                    request.append_token(token, now)
                except GrammarError as exc:
                    # Only this request is lost: the engine reports it failed (``error``).
                    request.error, status = str(exc), RequestStatus.FINISHED_ABORTED
                    break
                count += 1
                status = request.check_stop(self.config.max_model_len)
                if status is not None:
                    break
            received.append((request, count))
            if status is not None:
                self._finish(request, status, now)
                finished.add(request.request_id)
            elif spec:
                self.kv_cache.trim(request)  # the rejected proposals' slots
        if finished:
            self.running = [r for r in self.running if r.request_id not in finished]
        return received

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish a request from outside (stop string, client abort); frees its blocks now.

        Returns the request, or None when the id is unknown or already finished.
        """
        if not status.finished:
            raise ValueError(f"finish_request needs a finished status, got {status}")
        request = self._requests.get(request_id)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, status, time.monotonic())
        return request

    def stop_on_string(self, request: Request) -> None:
        """The detokenizer found a stop string in the request's last token: finish it as
        stopped (freeing its blocks), or re-label it if that token also ended it by length."""
        if request.is_finished:
            request.status = RequestStatus.FINISHED_STOPPED
        else:
            self.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)

    def abort_request(self, request_id: str) -> Request | None:
        """Abort a waiting or running request (``FINISHED_ABORTED``)."""
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    def _allocate_or_preempt(self, request: Request, num_new: int, preempted: list[str]) -> bool:
        """Allocate for a running request, preempting the last running ones (the newest of
        the lowest priority) until it fits.

        Returns False when ``request`` itself had to go. Only requests after it
        in ``running`` are preempted, and those are not scheduled yet this step.
        """
        while not self.kv_cache.allocate_slots(request, num_new):
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _scheduled(self, request: Request, num_new: int, spec: list[int] | None = None) -> ScheduledRequest:
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        start = request.num_computed_tokens
        spec = spec or []
        num_prompt_logits = 0
        if request.needs_prompt_logits:
            assert request.prompt_logprobs is not None and not spec
            # Positions [wanted, last) give prompt logprobs; the prompt's last position
            # gives the first sampled token instead.
            wanted = len(request.prompt_logprobs) - 1
            assert wanted >= start, "a prompt position's logits were skipped"
            num_prompt_logits = max(0, min(start + num_new, request.num_prompt_tokens - 1) - wanted)
        reaches_end = start + num_new == request.num_tokens
        pool = reaches_end and request.sampling_params.pooling is not None
        return ScheduledRequest(
            request=request,
            start_pos=start,
            num_new_tokens=num_new + len(spec),
            block_tables=self.kv_cache.get_block_tables(request.request_id),
            sample=reaches_end and not pool,
            spec_token_ids=spec,
            num_prompt_logits=num_prompt_logits,
            pool=pool,
        )

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request.request_id)
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.push_preempted(request)

    def _finish(self, request: Request, status: RequestStatus, now: float) -> None:
        self.kv_cache.free(request.request_id)
        self._requests.pop(request.request_id, None)
        request.status = status
        request.finished_time = now

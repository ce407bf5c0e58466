"""Output processing: what a step's sampled tokens mean to the API requests.

The engine's step hands over what it sampled (``StepResult``) once the
scheduler has appended it; this module owns the API requests from then on:
each one's ``n`` sequences and detokenizers (incremental text, stop strings
with hold-back), the deltas it gets, its end (finished, pooled, failed or
aborted) and the step's numbers for the stat loggers.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

import torch

from engine.detokenizer import IncrementalDetokenizer
from engine.lora_registry import LoRARegistry
from engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from engine.request import EngineRequest, Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.speculative import Speculator
from engine.stats import FinishedRequestStats, StatLogger, StepStats, StructuredRequestStats
from models.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass
class ApiRequest:
    """An API request: its ``n`` sequences and their detokenizers."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Request]
    detoks: list[IncrementalDetokenizer]
    counted_prompt: bool = False  # its prompt tokens are in the stats (once, with its first token)
    done: set[int] = field(default_factory=set)  # the sample indexes that finished


@dataclass
class StepResult:
    """One step's results, from the engine's step to :meth:`OutputProcessor.process`."""

    stats: StepStats  # this step's, filled in as the step goes
    # Request id -> the tokens it keeps this step (its sampled one, after the proposals
    # it confirmed), and their logprobs (None where not asked for).
    token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprob | None]] = field(default_factory=dict)
    # Each sampled request's last token's time before this step (None: none yet).
    last_token_times: dict[str, float | None] = field(default_factory=dict)
    # The embedding requests this step finished, and their prompts' last hidden states (row i: request i).
    pooled: list[Request] = field(default_factory=list)
    hidden: torch.Tensor | None = None


def finished_stats(seq: Request) -> FinishedRequestStats:
    """A sequence's life, when it leaves the engine (aborted ones included)."""
    now = time.monotonic()
    scheduled, first, finished = seq.first_scheduled_time, seq.first_token_time, seq.finished_time or now
    return FinishedRequestStats(
        finish_reason=seq.status.finish_reason or "abort",
        num_prompt_tokens=seq.num_prompt_tokens,
        num_generation_tokens=seq.num_output_tokens,
        e2e_latency=finished - seq.arrival_time,
        queue_time=(scheduled - seq.arrival_time) if scheduled is not None else 0.0,
        inference_time=finished - scheduled if scheduled is not None else None,
        prefill_time=first - scheduled if scheduled is not None and first is not None else None,
        decode_time=(seq.last_token_time or first) - first if first is not None else None,
    )


class OutputProcessor:
    """The API requests in the engine, from ``add`` until they finish or abort, and each
    step's deltas and stats.

    ``scheduler`` is told what only the text shows (a stop string) and which requests
    end here; ``adapters`` and ``speculator`` (None: no speculation) hear when a
    request leaves. ``stat_loggers`` get every step's stats.
    """

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: frozenset[int], scheduler: Scheduler,
                 adapters: LoRARegistry, speculator: Speculator | None) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.scheduler = scheduler
        self.adapters = adapters
        self.speculator = speculator
        self.stat_loggers: list[StatLogger] = []
        self.requests: dict[str, ApiRequest] = {}
        self._seq_to_api: dict[str, ApiRequest] = {}
        # Counters read at the last step: the stats report what changed since.
        self._last_kv_queries = 0
        self._last_kv_hits = 0
        self._last_preemptions = 0
        # What happened between steps (aborts, arrivals), reported with the next step.
        self._pending_finished: list[FinishedRequestStats] = []
        self._pending_structured: list[StructuredRequestStats] = []

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.requests

    def __len__(self) -> int:
        return len(self.requests)

    def add(self, request: EngineRequest, seqs: list[Request]) -> None:
        """Follow a request whose sequences ``seqs`` the scheduler now has; ``ValueError``
        if its id is in use."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.adapter is not None:
            assert request.lora is not None
            self.adapters.acquire(request.adapter, request.lora)
        if request.grammar is not None:
            self._pending_structured.append(StructuredRequestStats(request.grammar.kind,
                                                                   request.grammar.compile_seconds))
        api = ApiRequest(request.request_id, list(request.prompt_token_ids), request.params, seqs,
                         [IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, request.params)
                          for _ in seqs])
        self.requests[request.request_id] = api
        for seq in seqs:
            self._seq_to_api[seq.request_id] = api

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request (all its samples) and free its blocks now; its last delta
        (``finish_reason="abort"`` for the unfinished samples), or None for an unknown
        or finished id."""
        api = self.requests.get(request_id)
        if api is None:
            return None
        for seq in api.seqs:
            self.scheduler.abort_request(seq.request_id)  # no-op for samples already finished
        self._pending_finished.extend(self._retire(api))
        outs = [CompletionOutput(index=i, text="", token_ids=[], finish_reason="abort")
                for i in range(len(api.seqs)) if i not in api.done]
        return RequestOutput(request_id, outs, api.prompt_token_ids, finished=True,
                             num_cached_tokens=api.seqs[0].num_cached_tokens)

    def process(self, result: StepResult, updated: list[tuple[Request, int]]) -> list[RequestOutput]:
        """The step's deltas: for the sequences that got tokens (``updated``, with how
        many, from ``Scheduler.update_from_output``) and the pooled ones; then the
        step's stats go to the stat loggers."""
        stats = result.stats
        outputs = self._deltas(result, updated)
        if result.hidden is not None:
            outputs += self._pool(result.pooled, result.hidden, stats)
        self._fill_gauges(stats)
        for stat_logger in self.stat_loggers:
            stat_logger.record(stats)
        return outputs

    def _deltas(self, result: StepResult, updated: list[tuple[Request, int]]) -> list[RequestOutput]:
        stats = result.stats
        by_api: dict[str, list[CompletionOutput]] = {}
        # A sample the engine failed (a grammar fault) fails its whole request, alone.
        failed = {self._seq_to_api[seq.request_id].request_id: seq.error for seq, _ in updated if seq.error}
        for seq, count in updated:
            api = self._seq_to_api[seq.request_id]
            if api.request_id in failed:
                continue
            prev = result.last_token_times[seq.request_id]
            # A sample's first tokens come from its prompt's last position: its
            # prompt logprobs are complete and go out with them.
            assert prev is not None or not seq.needs_prompt_logits
            if prev is None:
                stats.time_to_first_token.append(seq.first_token_time - seq.arrival_time)
            else:
                stats.inter_token_latency.append(seq.last_token_time - prev)
            if not api.counted_prompt:
                api.counted_prompt = True
                stats.num_prompt_tokens += len(api.prompt_token_ids)
            detok = api.detoks[seq.sample_index]
            new, text = self._detokenize(seq, detok, count)
            lps = result.logprobs.get(seq.request_id, [])[:len(new)]
            stats.num_generation_tokens += len(new)
            if detok.finished:
                # A stop string ended it (even on the step that hit the length limit).
                seq.stop_reason = detok.stop_reason
                self.scheduler.stop_on_string(seq)
            elif seq.is_finished:
                text += detok.flush()
            by_api.setdefault(api.request_id, []).append(CompletionOutput(
                index=seq.sample_index, text=text, token_ids=new,
                logprobs=lps if lps and lps[0] is not None else None,
                finish_reason=seq.status.finish_reason, stop_reason=seq.stop_reason,
                prompt_logprobs=seq.prompt_logprobs if prev is None else None))
        results = []
        for rid, outs in by_api.items():
            api = self.requests[rid]
            for o in outs:
                if o.finish_reason is not None:
                    api.done.add(o.index)
            finished = len(api.done) == len(api.seqs)
            if finished:
                stats.finished.extend(self._retire(api))
            results.append(RequestOutput(rid, outs, api.prompt_token_ids, finished=finished,
                                         num_cached_tokens=api.seqs[0].num_cached_tokens))
        for rid, error in failed.items():
            logger.error("request %s failed: %s", rid, error)
            aborted = self.abort(rid)
            assert aborted is not None
            results.append(dataclasses.replace(aborted, outputs=[], error=f"structured output failed: {error}"))
        return results

    def _detokenize(self, seq: Request, detok: IncrementalDetokenizer, count: int) -> tuple[list[int], str]:
        """The sequence's ``count`` new tokens as text, and those of them that stay: a stop
        string cuts the tokens after it."""
        new = seq.output_token_ids[-count:]
        text = ""
        for i, token in enumerate(new):
            # A stop token (EOS or stop_token_ids) ends the text without being part of it.
            if i == len(new) - 1 and seq.status is RequestStatus.FINISHED_STOPPED and (
                    token in self.eos_token_ids or token in seq.sampling_params.stop_token_ids):
                break
            text += detok.update([token])
            if detok.finished:
                # Accepted proposals past the stop string were never generated.
                del seq.output_token_ids[len(seq.output_token_ids) - len(new) + i + 1:]
                new = new[:i + 1]
                break
        return new, text

    def _pool(self, pooled: list[Request], hidden: torch.Tensor, stats: StepStats) -> list[RequestOutput]:
        """Finish each embedding request of the step with its answer: its prompt's last
        hidden state (row i of ``hidden``), cut to ``dimensions``, L2-normalised."""
        results = []
        for seq, row in zip(pooled, hidden):
            params = seq.sampling_params.pooling
            assert params is not None
            vector = row[:params.dimensions] if params.dimensions is not None else row
            if params.normalize:
                vector = torch.nn.functional.normalize(vector, dim=0)
            self.scheduler.finish_request(seq.request_id, RequestStatus.FINISHED_STOPPED)
            api = self._seq_to_api[seq.request_id]
            stats.num_prompt_tokens += len(api.prompt_token_ids)
            stats.finished.extend(self._retire(api))
            results.append(RequestOutput(api.request_id, [CompletionOutput(
                index=0, text="", token_ids=[], finish_reason=RequestStatus.FINISHED_STOPPED.finish_reason,
                embedding=vector.tolist())], api.prompt_token_ids, finished=True,
                num_cached_tokens=seq.num_cached_tokens))
        return results

    def _retire(self, api: ApiRequest) -> list[FinishedRequestStats]:
        """Forget a finished or aborted request; one stats record per sequence (sample)."""
        del self.requests[api.request_id]
        for seq in api.seqs:
            self._seq_to_api.pop(seq.request_id, None)
            if self.speculator is not None:
                self.speculator.forget(seq.request_id)
        if api.seqs[0].adapter is not None:
            self.adapters.release(api.seqs[0].adapter)
        return [finished_stats(seq) for seq in api.seqs]

    def _fill_gauges(self, stats: StepStats) -> None:
        """The engine's state after the step, and what changed since the last one."""
        kv = self.scheduler.kv_cache.stats
        stats.num_running = self.scheduler.num_running
        stats.num_waiting = self.scheduler.num_waiting
        stats.kv_blocks_total = kv.num_blocks_total
        stats.kv_blocks_used = kv.num_blocks_used
        stats.kv_usage = kv.usage
        if self.adapters.weights:
            stats.lora_running = self.adapters.count_by_name(self.scheduler.running)
            stats.lora_waiting = self.adapters.count_by_name(self.scheduler.waiting)
        stats.prefix_cache_queries = kv.prefix_cache_queries - self._last_kv_queries
        stats.prefix_cache_hits = kv.prefix_cache_hits - self._last_kv_hits
        self._last_kv_queries, self._last_kv_hits = kv.prefix_cache_queries, kv.prefix_cache_hits
        preemptions = self.scheduler.num_preemptions_total
        stats.num_preemptions = preemptions - self._last_preemptions
        self._last_preemptions = preemptions
        stats.finished.extend(self._pending_finished)
        self._pending_finished.clear()
        stats.structured.extend(self._pending_structured)
        self._pending_structured.clear()

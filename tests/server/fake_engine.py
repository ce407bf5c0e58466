"""A deterministic in-process stand-in for ``engine.async_engine.AsyncEngine``.

It implements the same interface with no model: every sample of a request
types out ``SCRIPT`` one byte-token per step (sample ``k`` starts ``k``
characters in), and honours max_tokens (None = rest of the context), stop
strings (with hold-back, so stop text is never streamed), stop_token_ids,
EOS (``eos_at``), min_tokens, ignore_eos, n, logprobs, prompt logprobs, aborts and a simulated
prefix cache. It reports ``StepStats`` to stat loggers after every step and
can fail mid-stream (``fail_after_steps``) either with ``RequestOutput.error``
or by raising, as a dead engine loop does.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from engine.sampling_params import PoolingParams, SamplingParams
from engine.stats import FinishedRequestStats, StatLogger, StepStats
from engine.validation import InvalidRequestError, RequestLimits, check_request
from models.chat_template import TemplateArgumentError
from models.kv_cache import cdiv
from models.tokenizer import FimTokens

SCRIPT = "hello world, this is kvserve speaking. " * 8


class FakeEngineDeadError(RuntimeError):
    """Stands in for ``engine.async_engine.EngineDeadError``."""


# A code model's markers in the fake's vocabulary (set as a FakeTokenizer's fim_tokens).
FAKE_FIM = FimTokens(prefix=260, suffix=261, middle=262)


class FakeTokenizer:
    """Byte-level tokenizer: ids 0-255 are bytes, 256 is BOS, 257 is EOS; 260-262 are
    fill-in-the-middle markers where a test sets ``fim_tokens = FAKE_FIM``."""

    BOS, EOS = 256, 257
    vocab_size = 263
    eos_token_ids = [EOS]
    bos_token_id = BOS
    # The jinja2 source /tokenizer_info shows (apply_chat_template renders it in Python).
    chat_template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    ROLES = {"system", "developer", "user", "assistant", "tool"}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS] + ids if add_special_tokens else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        out, buf = [], bytearray()
        for i in ids:
            if i < 256:
                buf.append(i)
                continue
            out.append(buf.decode("utf-8", errors="replace"))
            buf = bytearray()
            if not skip_special_tokens:
                out.append({self.BOS: "<s>", self.EOS: "</s>"}.get(i, f"<{i}>"))
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if token_id < 256 else self.decode([token_id], False).encode()

    tool_call_syntax = None
    fim_tokens = None  # a test may set a models.tokenizer.FimTokens

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, template_kwargs: dict | None = None,
                            continue_final_message: bool = False) -> str:
        """Each message as ``<|role|>content``; ``template_kwargs`` shown as ``[name=value]``
        after the generation prompt (the real renderer refuses the names it sets itself)."""
        assert tools is None, "the fake's template knows nothing of tools"
        if "messages" in (template_kwargs or {}):
            raise TemplateArgumentError("chat_template_kwargs may not set 'messages'", "chat_template_kwargs")
        parts = []
        for m in messages:
            if m.get("role") not in self.ROLES or not isinstance(m.get("content"), str):
                raise ValueError(f"bad message {m!r}")
            thought = f"<think>{m['reasoning_content']}</think>" if "reasoning_content" in m else ""
            parts.append(f"<|{m['role']}|>{thought}{m['content']}\n")
        if add_generation_prompt:
            parts.append("<|assistant|>")
        parts += [f"[{k}={v}]" for k, v in sorted((template_kwargs or {}).items())]
        if continue_final_message:  # the last turn left open: no newline closes it
            parts[-1] = parts[-1].removesuffix("\n")
        return "".join(parts)


@dataclass
class _Sample:
    index: int
    text: str = ""  # all generated text, stop text included
    emitted: int = 0  # characters of ``text`` already sent
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class FakeRequest:
    """What the fake saw of one generate call (for assertions)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[_Sample] = field(default_factory=list)
    aborted: bool = False


FAKE_HIDDEN_SIZE = 8  # the fake model's embedding length


def fake_embedding(prompt: list[int], pooling: PoolingParams) -> list[float]:
    """A vector that depends on the prompt: ``[len, sum, last id, 1, ...]``, cut to
    ``dimensions`` and L2-normalised as the real engine does."""
    vector = [float(len(prompt)), float(sum(prompt)), float(prompt[-1])] + [1.0] * (FAKE_HIDDEN_SIZE - 3)
    vector = vector[:pooling.dimensions or FAKE_HIDDEN_SIZE]
    if pooling.normalize:
        norm = math.sqrt(sum(v * v for v in vector))
        vector = [v / norm for v in vector]
    return vector


class FakeEngine:
    """See the module docstring. Knobs are plain attributes, settable per test."""

    def __init__(self, *, model_name: str = "fake-model", max_model_len: int = 256,
                 block_size: int = 16, num_kv_blocks: int = 64, step_delay: float = 0.0,
                 eos_at: int | None = None, fail_after_steps: int | None = None,
                 fault: str = "error", lora_adapters: dict[str, str] | None = None) -> None:
        self.tokenizer = FakeTokenizer()
        self.lora_adapters = dict(lora_adapters or {})  # served adapter name -> directory
        self.script = SCRIPT  # what every sample types out (ASCII: one byte-token per character)
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.sampling_defaults: dict[str, Any] = {}  # generation_config.json and --override-generation-config
        self.sampling_overrides: dict[str, Any] = {}  # --override-generation-config alone
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks
        self.step_delay = step_delay
        self.eos_at = eos_at
        self.fail_after_steps = fail_after_steps
        self.fault = fault  # "error": RequestOutput.error; "raise": the loop dies
        self.priority_scheduling = False  # --scheduling-policy priority: requests' priorities taken
        self.is_alive = True
        self.started = False
        self.shut_down = False
        self.requests: list[FakeRequest] = []
        self.aborted: list[str] = []
        self._active: dict[str, FakeRequest] = {}
        self._abort_all: set[str] = set()
        self.groups: dict[str, str] = {}  # request id -> the group generate() was given
        self.adapters: dict[str, str | None] = {}  # request id -> the adapter generate() was given
        self._loggers: list[StatLogger] = []
        self._seen_prompts: list[list[int]] = []

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._active)

    def add_stat_logger(self, logger: StatLogger) -> None:
        self._loggers.append(logger)

    async def start(self) -> None:
        self.started = True

    def run_loop(self, give_up: threading.Event | None = None) -> None:
        """The fake steps on its own; like the real loop, return once shut down, or once
        the HTTP side gave up. Records the thread it ran on."""
        self.loop_thread = threading.current_thread()
        while not self.shut_down and not (give_up is not None and give_up.is_set()):
            time.sleep(0.05)

    async def shutdown(self) -> None:
        self.shut_down = True
        self.is_alive = False

    def _cached_tokens(self, prompt: list[int]) -> int:
        best = 0
        for seen in self._seen_prompts:
            common = 0
            for a, b in zip(seen, prompt):
                if a != b:
                    break
                common += 1
            best = max(best, common)
        # Only full blocks are cached, and the last prompt token is always computed.
        return min(best, len(prompt) - 1) // self.block_size * self.block_size

    def _blocks_used(self) -> int:
        used = 0
        for req in self._active.values():
            for s in req.samples:
                used += cdiv(len(req.prompt_token_ids) + s.num_tokens, self.block_size)
        return used

    def _emit(self, stats: StepStats) -> None:
        stats.num_running = len(self._active)
        stats.kv_blocks_total = self.num_kv_blocks
        stats.kv_blocks_used = min(self._blocks_used(), self.num_kv_blocks)
        stats.kv_usage = stats.kv_blocks_used / self.num_kv_blocks
        for logger in self._loggers:
            logger.record(stats)

    def _next_token(self, req: FakeRequest, s: _Sample) -> int:
        p = req.params
        if self.eos_at is not None and s.num_tokens >= self.eos_at and not p.ignore_eos \
                and s.num_tokens >= p.min_tokens:
            return FakeTokenizer.EOS
        return ord(self.script[(s.index + s.num_tokens) % len(self.script)])

    def _advance(self, req: FakeRequest, s: _Sample, limit: int) -> CompletionOutput:
        """Generate one token for ``s`` and return its delta."""
        p = req.params
        tok = self._next_token(req, s)
        s.num_tokens += 1
        if tok == FakeTokenizer.EOS:
            s.finish_reason = "stop"
        elif tok in p.stop_token_ids and s.num_tokens > p.min_tokens:
            s.finish_reason, s.stop_reason = "stop", tok
        else:
            s.text += chr(tok)
        end = len(s.text)
        if s.finish_reason is None and s.num_tokens > p.min_tokens:
            for stop in p.stop:
                pos = s.text.find(stop)
                if pos >= 0:
                    s.finish_reason, s.stop_reason = "stop", stop
                    end = pos + len(stop) if p.include_stop_str_in_output else pos
                    s.text = s.text[:end]
                    break
        if s.finish_reason is None and s.num_tokens >= limit:
            s.finish_reason = "length"
        if s.finish_reason is None:
            # Hold back any tail that could still become a stop string.
            hold = max((k for stop in p.stop for k in range(1, len(stop))
                        if s.text.endswith(stop[:k])), default=0)
            end = len(s.text) - hold
        delta, s.emitted = s.text[s.emitted:end], max(s.emitted, end)
        logprobs = None
        if p.logprobs is not None:
            alts = [(tok, -0.25)] + [(ord("x") + i, -2.0 - i) for i in range(20)]
            logprobs = [TokenLogprob(token_id=tok, logprob=-0.25, top=alts[:p.logprobs])]
        prompt_logprobs = None
        if p.prompt_logprobs is not None and s.num_tokens == 1:
            # Prompt token i: logprob -i/2, the most likely; "x", "y", ... below it.
            prompt_logprobs = [None] + [
                TokenLogprob(t, -i / 2, ([(t, -i / 2)] + [(ord("x") + j, -10.0 - j) for j in range(20)])
                             [:p.prompt_logprobs], rank=1)
                for i, t in enumerate(req.prompt_token_ids) if i]
        return CompletionOutput(index=s.index, text=delta, token_ids=[tok], logprobs=logprobs,
                                finish_reason=s.finish_reason, stop_reason=s.stop_reason,
                                prompt_logprobs=prompt_logprobs)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    async def load_adapter(self, name: str, path: str) -> None:
        """As the real engine: ``InvalidRequestError`` for a name in use or a path that is
        not a directory."""
        if name in self.lora_adapters or name == self.model_name:
            raise InvalidRequestError(f"The model '{name}' is already served.", "lora_name")
        if not Path(path).is_dir():
            raise InvalidRequestError(f"LoRA adapter {name!r}: {path} has no adapter_config.json", "lora_path")
        self.lora_adapters[name] = path

    async def unload_adapter(self, name: str) -> None:
        if self.lora_adapters.pop(name, None) is None:
            raise ValueError(f"no LoRA adapter named {name!r} is loaded")

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 group: str | None = None, adapter: str | None = None) -> AsyncIterator[RequestOutput]:
        """The real engine's check (``InvalidRequestError`` at once), then the stream."""
        assert adapter is None or adapter in self.lora_adapters, adapter
        limits = RequestLimits(vocab_size=self.vocab_size, max_model_len=self.max_model_len,
                               hidden_size=FAKE_HIDDEN_SIZE, priority_scheduling=self.priority_scheduling)
        limit = check_request(prompt_token_ids, params, limits)
        self.groups[request_id] = group or request_id
        self.adapters[request_id] = adapter
        return self._stream(request_id, list(prompt_token_ids), params, limit)

    def abort_all(self) -> None:
        self._abort_all.update(self._active)

    async def _stream(self, request_id: str, prompt: list[int], params: SamplingParams,
                      limit: int) -> AsyncIterator[RequestOutput]:
        """Yield one ``RequestOutput`` per step until every sample finishes."""
        n_prompt = len(prompt)
        if not self.is_alive:
            raise FakeEngineDeadError("engine is dead")
        req = FakeRequest(request_id, prompt, params, [_Sample(k) for k in range(params.n)])
        self.requests.append(req)
        self._active[request_id] = req
        cached = self._cached_tokens(prompt)
        self._seen_prompts.append(prompt)
        arrival = last = time.monotonic()
        steps = 0
        try:
            while True:
                await asyncio.sleep(self.step_delay)
                now = time.monotonic()
                stats = StepStats()
                if request_id in self._abort_all:
                    self._abort_all.discard(request_id)
                    outs = [CompletionOutput(s.index, "", [], finish_reason="abort")
                            for s in req.samples if s.finish_reason is None]
                    for s in req.samples:
                        if s.finish_reason is None:
                            s.finish_reason = "abort"
                            stats.finished.append(self._finished(req, s, arrival, now))
                    del self._active[request_id]
                    self._emit(stats)
                    yield RequestOutput(request_id, outs, prompt, finished=True,
                                        num_cached_tokens=cached)
                    return
                if self.fail_after_steps is not None and steps >= self.fail_after_steps:
                    del self._active[request_id]
                    if self.fault == "raise":
                        self.is_alive = False
                        raise FakeEngineDeadError("engine loop died")
                    yield RequestOutput(request_id, [], prompt, finished=True,
                                        num_cached_tokens=cached, error="simulated engine fault")
                    return
                if steps == 0:
                    stats.num_prompt_tokens = n_prompt
                    stats.prefix_cache_queries = n_prompt
                    stats.prefix_cache_hits = cached
                    stats.num_batched_tokens = n_prompt - cached
                    stats.time_to_first_token.append(now - arrival)
                if params.pooling is not None:  # an embedding: one delta, its answer
                    sample = req.samples[0]
                    sample.finish_reason = "stop"
                    stats.finished.append(self._finished(req, sample, arrival, now))
                    del self._active[request_id]
                    self._emit(stats)
                    yield RequestOutput(request_id, [CompletionOutput(
                        0, "", [], finish_reason="stop", embedding=fake_embedding(prompt, params.pooling))],
                        prompt, finished=True, num_cached_tokens=cached)
                    return
                running = [s for s in req.samples if s.finish_reason is None]
                outs = [self._advance(req, s, limit) for s in running]
                stats.num_generation_tokens = len(outs)
                stats.num_batched_tokens += len(outs)
                if steps > 0:
                    stats.inter_token_latency.extend([now - last] * len(outs))
                for s in running:
                    if s.finish_reason is not None:
                        stats.finished.append(self._finished(req, s, arrival, now))
                steps += 1
                last = now
                done = all(s.finish_reason is not None for s in req.samples)
                if done:
                    del self._active[request_id]
                self._emit(stats)
                yield RequestOutput(request_id, outs, prompt, finished=done,
                                    num_cached_tokens=cached)
                if done:
                    return
        finally:
            # Reached on close/cancel (client gone) as well: abort and free.
            if request_id in self._active:
                del self._active[request_id]
                req.aborted = True
                self.aborted.append(request_id)
                stats = StepStats(finished=[self._finished(req, s, arrival, time.monotonic())
                                            for s in req.samples if s.finish_reason is None])
                self._emit(stats)

    @staticmethod
    def _finished(req: FakeRequest, s: _Sample, arrival: float, now: float) -> FinishedRequestStats:
        return FinishedRequestStats(finish_reason=s.finish_reason or "abort",
                                    num_prompt_tokens=len(req.prompt_token_ids),
                                    num_generation_tokens=s.num_tokens,
                                    e2e_latency=now - arrival, queue_time=0.0, inference_time=now - arrival,
                                    prefill_time=0.0 if s.num_tokens else None,
                                    decode_time=now - arrival if s.num_tokens else None)

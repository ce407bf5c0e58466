"""The server's shared state and the admission checks every generation runs."""

from __future__ import annotations

import inspect
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any
from dataclasses import dataclass

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from server.engine_client import EngineClient
from server.errors import bad_request, model_not_found, unavailable
from server.metrics import PrometheusStatLogger
from server.protocol import check_token_ids


@dataclass
class ServerState:
    """Everything the routes share; one per app (``app.state.kvserve``)."""

    engine: EngineClient
    model_name: str
    metrics: PrometheusStatLogger
    api_key: str | None = None
    max_queue: int | None = None
    draining: bool = False
    started: bool = False

    def check_model(self, model: str | None) -> None:
        """404 unless ``model`` is unset or the served name."""
        if model is not None and model != self.model_name:
            raise model_not_found(model)

    def admit(self) -> None:
        """503 when the engine is dead or the queue is full (draining is checked
        earlier, in ``server.middleware``, for every route)."""
        if not self.engine.is_alive:
            raise unavailable("The engine is not running.")
        if self.max_queue is not None and self.engine.num_unfinished_requests >= self.max_queue:
            raise unavailable(f"The server is overloaded ({self.max_queue} requests queued); "
                              "retry later.")

    def check_prompt(self, ids: list[int], params: SamplingParams, param: str) -> None:
        """400 for ids outside the vocabulary or a prompt that cannot fit the context."""
        vocab = self.engine.tokenizer.vocab_size
        check_token_ids(ids, vocab, param)
        check_token_ids(params.stop_token_ids, vocab, "stop_token_ids")
        check_token_ids(list(params.logit_bias), vocab, "logit_bias")
        limit = self.engine.max_model_len
        n, want = len(ids), params.max_tokens
        if want is None and n >= limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, "
                              f"your prompt has {n} tokens, which leaves no room for the "
                              "completion. Please shorten the prompt.", param)
        if want is not None and n + want > limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, "
                              f"you requested {n + want} tokens ({n} in the prompt, {want} for "
                              "the completion). Please reduce the length of the prompt or "
                              "max_tokens.", param)


def new_request_id(prefix: str) -> str:
    """A server-minted id such as ``cmpl-1f0c...`` or ``chatcmpl-...``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def start_generation(engine: EngineClient, request_id: str, prompt_ids: list[int],
                     params: SamplingParams) -> AsyncIterator[RequestOutput]:
    """Call ``engine.generate``; also accepts an engine whose ``generate`` is a
    coroutine returning the iterator, by awaiting it on first use."""
    try:
        it: Any = engine.generate(request_id, prompt_ids, params)
    except ValueError as e:  # refused on the spot rather than on first iteration
        raise bad_request(str(e)) from None
    if inspect.isawaitable(it):
        return _await_then_iterate(it)
    return it


async def _await_then_iterate(
        awaitable: Awaitable[AsyncIterator[RequestOutput]]) -> AsyncIterator[RequestOutput]:
    it = await awaitable
    try:
        async for out in it:
            yield out
    finally:
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            await aclose()

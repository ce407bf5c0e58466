"""The server's shared state and the admission checks every generation runs."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from pydantic import BaseModel

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams, ThinkTokens
from engine.validation import InvalidRequestError
from server.engine_client import EngineClient
from server.errors import bad_request, model_not_found, unavailable
from server.metrics import PrometheusStatLogger
from server.reasoning import ReasoningFormat
from server.response_store import ResponseStore
from server.tools import FORMATS, ToolFormat

logger = logging.getLogger(__name__)

DEFAULT_STORED_RESPONSES = 1024

RequestT = TypeVar("RequestT", bound=BaseModel)


@dataclass
class ServerState:
    """Everything the routes share; one per app (``app.state.kvserve``).

    The event loop's thread owns it; only :meth:`begin_drain` may be called
    from another thread (a signal handler).
    """

    engine: EngineClient
    model_name: str
    metrics: PrometheusStatLogger
    # More names a request may give the base model by (vLLM's --served-model-name A B ...):
    # answered under model_name.
    model_aliases: tuple[str, ...] = ()
    api_key: str | None = None
    max_queue: int | None = None
    tool_format: ToolFormat = FORMATS["generic"]
    # --reasoning-parser: how a thinking model's reasoning is told from its answer.
    reasoning: ReasoningFormat | None = None
    # Its markers as single tokens, for constrained answers that think first (None: they cannot).
    think_tokens: ThinkTokens | None = None
    # Stored Responses API answers (previous_response_id, GET /v1/responses/{id}).
    responses: ResponseStore = field(default_factory=lambda: ResponseStore(DEFAULT_STORED_RESPONSES))
    # --enable-log-requests: one log line per generation request (server.driver.log_request), its prompt
    # cut to max_log_len characters and ids (None: whole).
    log_requests: bool = False
    max_log_len: int | None = None
    draining: bool = False
    started: bool = False
    loop: asyncio.AbstractEventLoop | None = None  # set by the app's lifespan
    # Admitted generation requests not yet answered, by id: when each was admitted.
    in_flight: dict[str, float] = field(default_factory=dict)
    _abort_scheduled: bool = False

    def check_model(self, model: str | None) -> str:
        """The served name that answers a request for ``model``: the base model's when
        unset or one of its names, else ``model`` itself when it is a LoRA adapter's
        name (``--lora-modules``); 404 for any other."""
        if model is None or model == self.model_name or model in self.model_aliases:
            return self.model_name
        if model in self.engine.lora_adapters:
            return model
        raise model_not_found(model)

    def with_model_defaults(self, body: RequestT) -> RequestT:
        """``body`` with the model's recommended sampling (``engine.sampling_defaults``, from
        its generation_config.json) where the request left a setting out."""
        unset = {k: v for k, v in self.engine.sampling_defaults.items() if getattr(body, k, 0) is None}
        return body.model_copy(update=unset) if unset else body

    def adapter(self, served: str) -> str | None:
        """The LoRA adapter a request answered by ``served`` runs (None: the base model)."""
        return served if served != self.model_name and served not in self.model_aliases else None

    def admit(self, request_id: str) -> Callable[[], None]:
        """Take a place for ``request_id`` or raise 503: the engine is dead, or
        ``max_queue`` requests are in flight (draining is checked earlier, in
        ``server.middleware``, for every route).

        Returns the function that gives the place back (idempotent). Counting
        here, on the event loop, rather than reading the engine's count makes
        the bound hold for requests that arrive together: the engine learns of
        a request only when its stream starts.
        """
        if not self.engine.is_alive:
            raise unavailable("The engine is not running.")
        if self.max_queue is not None and len(self.in_flight) >= self.max_queue:
            raise unavailable(f"The server is overloaded ({self.max_queue} requests queued); "
                              "retry later.")
        self.in_flight[request_id] = time.monotonic()

        def release() -> None:
            self.in_flight.pop(request_id, None)

        return release

    def begin_drain(self, timeout: float) -> None:
        """Refuse new requests from now on; abort the ones still running after
        ``timeout`` seconds, so that their clients get an error (an SSE error
        event and ``[DONE]``, or a 503) rather than a cut connection.

        Thread-safe: called from the signal handler on the main thread.
        """
        self.draining = True
        if self.loop is not None and not self._abort_scheduled:
            self._abort_scheduled = True
            self.loop.call_soon_threadsafe(self.loop.call_later, timeout, self._abort_in_flight,
                                           timeout)

    def _abort_in_flight(self, timeout: float) -> None:
        now = time.monotonic()
        for request_id, admitted in self.in_flight.items():
            logger.warning("aborting request %s: still running %.1f s after it was admitted, "
                           "past the %.1f s drain (--shutdown-timeout)", request_id,
                           now - admitted, timeout)
        if self.in_flight:
            self.engine.abort_all()


def new_request_id(prefix: str) -> str:
    """A server-minted id such as ``cmpl-1f0c...`` or ``chatcmpl-...``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def start_generation(engine: EngineClient, request_id: str, prompt_ids: list[int],
                     params: SamplingParams, body_fields: Mapping[str, str],
                     group: str, adapter: str | None = None) -> AsyncIterator[RequestOutput]:
    """``engine.generate``, with the engine's refusal as OpenAI's 400.

    ``body_fields`` names the body field behind an engine parameter where the
    two differ: the prompt's (``prompt`` or ``messages``) and the structured
    output's (``response_format``, ``structured_outputs`` or ``tools``), named
    in the error when that parameter is at fault; ``group`` is the API request
    the prompt belongs to; ``adapter`` the LoRA adapter it runs.
    """
    try:
        return engine.generate(request_id, prompt_ids, params, group=group, adapter=adapter)
    except InvalidRequestError as e:
        raise bad_request(str(e), body_fields.get(e.param, e.param)) from None

"""The server's shared state and the admission checks every generation runs."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.validation import InvalidRequestError
from server.engine_client import EngineClient
from server.errors import bad_request, model_not_found, unavailable
from server.metrics import PrometheusStatLogger


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


def new_request_id(prefix: str) -> str:
    """A server-minted id such as ``cmpl-1f0c...`` or ``chatcmpl-...``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def start_generation(engine: EngineClient, request_id: str, prompt_ids: list[int],
                     params: SamplingParams, prompt_param: str) -> AsyncIterator[RequestOutput]:
    """``engine.generate``, with the engine's refusal as OpenAI's 400.

    ``prompt_param`` is the body field the prompt came from (``prompt`` or
    ``messages``), named in the error when the prompt itself is at fault.
    """
    try:
        return engine.generate(request_id, prompt_ids, params)
    except InvalidRequestError as e:
        raise bad_request(str(e), prompt_param if e.param == "prompt" else e.param) from None

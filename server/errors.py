"""OpenAI-shaped errors and the exception handlers that produce them.

Every failure leaves the server as ``{"error": {"message", "type", "param",
"code"}}``. Client mistakes are always 4xx: FastAPI's 422 for validation
becomes 400, unknown routes are 404, and only engine faults or bugs are 5xx.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

# Seconds a client should wait before retrying an overloaded or draining server.
RETRY_AFTER_SECONDS = 1


class APIError(Exception):
    """An error with an HTTP status that is sent to the client as-is."""

    def __init__(self, status_code: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        """The JSON body of this error (also used for in-stream error events)."""
        return error_body(self.message, self.type, self.param, self.code)

    def body_json(self) -> str:
        return json.dumps(self.body(), ensure_ascii=False)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


class ClientDisconnected(Exception):
    """The client went away before its response was ready (or while its body was read)."""


def error_body(message: str, type: str, param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    """The OpenAI error envelope."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@contextmanager
def renamed_params(names: Mapping[str, str]) -> Iterator[None]:
    """Rename the field a 400 raised inside names (by its first part) as ``names`` says:
    an API translated into a chat request names its own fields, not chat's."""
    try:
        yield
    except APIError as e:
        if e.param:
            head = e.param.replace("[", ".").split(".", 1)[0]
            # (a chat message's index is not the other API's item's: the field alone)
            e.param = names.get(head, e.param)
        raise


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", param="model",
                    code="model_not_found")


def response_not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found (kvserve keeps stored responses "
                         "in memory, the newest --max-stored-responses of them, per server).",
                    param="response_id", code="response_not_found")


def unauthorized() -> APIError:
    return APIError(401, "Invalid or missing API key. Send 'Authorization: Bearer <key>'.",
                    type="authentication_error", code="invalid_api_key")


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"Request body is larger than the limit of {limit} bytes.",
                    code="request_too_large")


def unavailable(message: str) -> APIError:
    return APIError(503, message, type="server_error", code="service_unavailable",
                    headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def engine_fault(detail: str) -> APIError:
    return APIError(500, f"The engine failed while serving this request: {detail}",
                    type="server_error", code="engine_error")


_PRIMITIVE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _is_union_tag(item: object) -> bool:
    # pydantic names the union member an error came from inside the location,
    # e.g. ("prompt", "list[int]", 0); it means nothing to an API client.
    return isinstance(item, str) and (item in _PRIMITIVE_TAGS or "[" in item or "-" in item
                                      or item[:1].isupper())


def validation_message(err: ValidationError | RequestValidationError) -> tuple[str, str | None]:
    """A readable one-line message and the offending top-level parameter."""
    by_loc: dict[str, list[str]] = {}
    param = None
    for e in err.errors():
        # FastAPI prefixes locations with "body"/"query"/"path"; drop it, keep the field path
        # (a body field may itself be named "query": the rerank API's).
        loc = list(e.get("loc", ()))
        if isinstance(err, RequestValidationError) and loc and loc[0] in ("body", "query", "path"):
            loc = loc[1:]
        loc = [str(x) for x in loc if not _is_union_tag(x)]
        if param is None and loc:
            param = loc[0]
        msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
        msgs = by_loc.setdefault(".".join(loc), [])
        if msg not in msgs:
            msgs.append(msg)
    parts = [f"{where}: {' or '.join(msgs)}" if where else " or ".join(msgs)
             for where, msgs in by_loc.items()]
    return "; ".join(parts) or "Invalid request.", param


def install_exception_handlers(app: FastAPI) -> None:
    """Route every exception type the app can meet to an OpenAI error body."""

    async def on_api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return exc.response()

    async def on_validation(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, (RequestValidationError, ValidationError))
        message, param = validation_message(exc)
        return bad_request(message, param).response()

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 404:
            return APIError(404, f"No route {request.method} {request.url.path}.",
                            code="not_found").response()
        type_ = "server_error" if exc.status_code >= 500 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type=type_,
                        headers=getattr(exc, "headers", None)).response()

    async def on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error", exc_info=exc)
        return APIError(500, "Internal server error.", type="server_error").response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(ValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)

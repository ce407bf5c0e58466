"""Pure ASGI middleware: API key auth, the drain gate and the body size limit.

Pure ASGI (not ``BaseHTTPMiddleware``) so that streaming responses pass
through untouched and the body limit can act on the byte stream itself.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import APIError, bad_request, body_too_large, unauthorized, unavailable

# Probes and scrapes stay open without a key (load balancers and Prometheus
# usually have none) and while draining (they report the drain themselves).
OPEN_PATHS = frozenset({"/health", "/ping", "/ready", "/metrics"})


async def _send_error(err: APIError, scope: Scope, receive: Receive, send: Send) -> None:
    await err.response()(scope, receive, send)


class APIKeyMiddleware:
    """Require ``Authorization: Bearer <key>`` (or Anthropic's ``x-api-key: <key>``) on
    every path but ``open_paths``."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.app = app
        self._key = api_key.encode("utf-8")
        self._open = open_paths

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                # Constant-time comparison so the key cannot be guessed byte by byte.
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)
            if name == b"x-api-key":  # Anthropic's clients send the key so
                return hmac.compare_digest(value.strip(), self._key)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and scope["path"] not in self._open
                and not self._authorized(scope)):
            await _send_error(unauthorized(), scope, receive, send)
            return
        await self.app(scope, receive, send)


class DrainMiddleware:
    """Once ``is_draining()`` is true, refuse new requests with 503 + Retry-After."""

    def __init__(self, app: ASGIApp, is_draining: Callable[[], bool]) -> None:
        self.app = app
        self.is_draining = is_draining

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS and self.is_draining():
            await _send_error(unavailable("The server is shutting down."), scope, receive, send)
            return
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """Refuse bodies over ``max_body_size`` bytes with 413, without reading them whole.

    A declared ``Content-Length`` over the limit is refused before the app
    runs; a chunked body is counted as it arrives, and ``receive`` raises the
    413 ``APIError`` (answered by the app's handler) at the first chunk that
    crosses the limit.
    """

    def __init__(self, app: ASGIApp, max_body_size: int) -> None:
        self.app = app
        self.max_body_size = max_body_size

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_body_size
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    err = bad_request("Invalid Content-Length header.")
                    await _send_error(err, scope, receive, send)
                    return
                if declared > limit:
                    await _send_error(body_too_large(limit), scope, receive, send)
                    return

        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise body_too_large(limit)
            return message

        await self.app(scope, limited_receive, send)

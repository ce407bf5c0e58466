"""Fixtures for the HTTP layer tests: a fake engine and an ASGI client.

NOTE: tests/ has no __init__.py, so pytest puts this directory on sys.path and
the test modules import ``fake_engine`` and ``api_helpers`` by bare name.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from server.app import build_app
from fake_engine import FakeEngine


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
async def client(engine: FakeEngine) -> AsyncIterator[httpx.AsyncClient]:
    """A client for ``build_app(engine)`` with its lifespan running."""
    app = build_app(engine)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test") as c:
            yield c

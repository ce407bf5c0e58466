"""Fixtures for the HTTP layer tests: the real engine on a tiny random checkpoint, and an
ASGI client.

NOTE: tests/ has no __init__.py, so pytest puts this directory on sys.path and
the test modules import ``real_engine`` and ``api_helpers`` by bare name.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import httpx
import pytest

from real_engine import ServedEngine, build_engine, start_loop, write_tiny_checkpoint
from server.app import build_app
from server.tools import OpenAIHarmonyFormat


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory, gguf_tokenizer) -> Path:
    """A 2-layer random Llama with SmolLM2's tokenizer and chat template, made once."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("server-tiny"), gguf_tokenizer)


@pytest.fixture(scope="session")
def tiny_loaded(tiny_checkpoint: Path):
    """The tiny checkpoint loaded once (float32, CPU); every engine shares its weights."""
    from models.loader import load_model

    return load_model(str(tiny_checkpoint), dtype="float32", device="cpu", quantization="none")


def _engines(loaded, checkpoint: Path) -> Iterator[Callable[..., ServedEngine]]:
    loops = []

    def make(**overrides) -> ServedEngine:
        engine = build_engine(loaded, checkpoint, **overrides)
        loops.append(start_loop(engine))
        return ServedEngine(engine)

    yield make
    for thread, give_up in loops:
        give_up.set()
        thread.join(timeout=30)
        assert not thread.is_alive(), "an engine loop was started and never shut down"


@pytest.fixture
def make_engine(tiny_loaded, tiny_checkpoint: Path) -> Iterator[Callable[..., ServedEngine]]:
    """``make_engine(**engine_config_fields)`` -> a ``ServedEngine`` whose loop runs on a
    thread of its own; the app's lifespan starts and shuts it down (loops never started
    are stopped at teardown)."""
    yield from _engines(tiny_loaded, tiny_checkpoint)


@pytest.fixture(scope="session")
def think_checkpoint(tmp_path_factory: pytest.TempPathFactory, gguf_tokenizer) -> Path:
    """The tiny checkpoint's twin whose tokenizer has ``<think>`` and ``</think>`` as single
    tokens (as Qwen3's has), and harmony's tags (as gpt-oss's has), made once."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("server-think"), gguf_tokenizer,
                                 added=("<think>", "</think>", *OpenAIHarmonyFormat.TAGS))


@pytest.fixture(scope="session")
def think_loaded(think_checkpoint: Path):
    from models.loader import load_model

    return load_model(str(think_checkpoint), dtype="float32", device="cpu", quantization="none")


@pytest.fixture
def make_think_engine(think_loaded, think_checkpoint: Path) -> Iterator[Callable[..., ServedEngine]]:
    """``make_engine`` on ``think_checkpoint``."""
    yield from _engines(think_loaded, think_checkpoint)


@pytest.fixture
def engine(make_engine) -> ServedEngine:
    return make_engine()


@pytest.fixture
async def client(engine) -> AsyncIterator[httpx.AsyncClient]:
    """A client for ``build_app(engine)`` with its lifespan running."""
    app = build_app(engine)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test") as c:
            yield c

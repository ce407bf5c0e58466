"""End-to-end fixtures: ONE real ``kvserve serve`` process for the whole session.

The server runs the real default model (float32, CPU unless a GPU is present)
with API-key auth on and one LoRA adapter, so every e2e test (the OpenAI client, /metrics, the auth
walk, Prometheus) shares a single model load. Tests run one at a time, so no
request of another test is in flight while a test reads counters.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import openai
import pytest

from e2e_helpers import ADAPTER, SMOLLM2_SHAPE, KVServe, free_port

STARTUP_TIMEOUT = 120.0
SHUTDOWN_TIMEOUT = 10.0


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory, make_lora) -> Iterator[KVServe]:
    """A live ``kvserve serve --api-key ... --lora-modules sql=... --allow-runtime-lora`` (with vLLM's
    ``--enable-lora --max-loras 2 --max-lora-rank 8``, requests logged, CORS for one origin) on a free port; on teardown SIGTERM must
    make it exit with status 0 within its shutdown timeout."""
    log_dir = tmp_path_factory.mktemp("kvserve")
    adapter = make_lora(log_dir / ADAPTER, SMOLLM2_SHAPE, rank=8, seed=3)
    srv = KVServe(free_port(), log_dir / "server.log", api_key="e2e-" + secrets.token_hex(8),
                  shutdown_timeout=SHUTDOWN_TIMEOUT, extra=("--lora-modules", f"{ADAPTER}={adapter}", "--allow-runtime-lora",
                         "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                         "--enable-log-requests", "--max-log-len", "40",
                         "--allowed-origins", '["http://chat.example"]'))
    try:
        srv.wait_http_ok(f"{srv.url}/health", STARTUP_TIMEOUT)
        yield srv
    finally:
        # Uvicorn's graceful shutdown plus the engine thread's join; a few seconds of slack.
        rc = srv.stop(SHUTDOWN_TIMEOUT + 20)
    assert rc == 0, f"kvserve exited with {rc} after SIGTERM; {srv.describe()}"
    assert "Traceback" not in srv.log(tail=10**7), srv.describe()


@pytest.fixture(scope="session")
def client(server: KVServe) -> openai.OpenAI:
    """The official OpenAI client pointed at the server, with the right key and no retries
    (a retry would hide a failed request and double the counters)."""
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0,
                         timeout=120.0)

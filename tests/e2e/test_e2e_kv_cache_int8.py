"""``kvserve serve --kv-cache-dtype int8`` end to end: CLI -> HTTP -> engine -> the int8 cache kernels."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from e2e_helpers import MODEL, KVServe, free_port, idle, metric, wait_until

pytestmark = pytest.mark.slow


def test_int8_kv_cache_serves_the_same_text_streamed_and_whole(tmp_path: Path) -> None:
    srv = KVServe(free_port(), tmp_path / "server.log", api_key=None, shutdown_timeout=5.0,
                  extra=["--kv-cache-dtype", "int8"])
    try:
        srv.wait_http_ok(f"{srv.url}/health", 120.0)
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120.0)
        request = dict(model=MODEL, prompt="The capital of France is", max_tokens=16, temperature=0.0)

        whole = client.completions.create(**request).choices[0].text
        streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(stream=True, **request)
                           if chunk.choices)

        assert whole.strip() and streamed == whole
        samples = wait_until(srv.metrics, idle, 10.0)
        assert idle(samples), "a request still holds KV blocks"
        # 256 MiB of int8 rows (64 codes + a float32 scale per token and KV head, 30
        # layers, 3 KV heads, blocks of 16): 1370 blocks, where float16 would give 728.
        assert metric(samples, "kv_cache_blocks_total") == 256 * 2**20 // (2 * 30 * 16 * 3 * 68) == 1370
    finally:
        rc = srv.stop(30.0)
    assert rc == 0, srv.describe()
    assert "KV cache: 1370 blocks" in srv.log() and "int8" in srv.log(), srv.describe()

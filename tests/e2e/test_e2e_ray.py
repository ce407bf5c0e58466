"""Replicas on Ray Serve (``kvserve serve --replicas 2``): one endpoint, both replicas serving.

32 concurrent streams through Ray's HTTP proxy must all succeed and both
replicas must serve some (their metrics, labelled ``replica``, say so). A
replica killed mid-load must be replaced while the other keeps serving: no
request that started after the kill fails, and afterwards no replica holds a
KV block.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is kvserve's [ray] extra, which `make setup` installs")

from e2e_helpers import KVServe, free_port, parse_metrics, wait_until  # noqa: E402

pytestmark = pytest.mark.slow

STARTUP_TIMEOUT = 240.0
REPLACE_TIMEOUT = 180.0


@pytest.fixture(scope="module")
def ray_server(tmp_path_factory) -> Iterator[KVServe]:
    log = tmp_path_factory.mktemp("ray") / "server.log"
    srv = KVServe(free_port(), log, api_key=None, shutdown_timeout=5.0,
                  extra=["--replicas", "2", "--max-model-len", "512", "--kv-cache-memory", "32MiB"])
    try:
        srv.wait_http_ok(f"{srv.url}/health", STARTUP_TIMEOUT)
        assert len(wait_until(lambda: replicas(srv), lambda r: len(r) == 2, 60)) == 2, srv.describe()
        # A replica registers itself from its constructor, before Serve's controller marks it
        # running and the proxy's router hears of it: until then every request goes to the
        # other one. Wait until the router has sent a request to each.
        served = wait_until(lambda: serve_one_each(srv), lambda s: len(s) == 2 and all(s.values()), 60)
        assert len(served) == 2 and all(served.values()), (served, srv.describe())
        yield srv
    finally:
        rc = srv.stop(90)
    assert rc == 0, srv.describe()


def replicas(srv: KVServe) -> dict[str, dict]:
    r = httpx.get(f"{srv.url}/replicas", timeout=30)
    return r.json() if r.status_code == 200 else {}


def by_replica(srv: KVServe, sample: str, **labels: str) -> dict[str, float]:
    """``sample``'s value on each replica (the ``replica`` label of the merged /metrics)."""
    out: dict[str, float] = {}
    for (name, labelset), value in srv.metrics().items():
        found = dict(labelset)
        if name == sample and all(found.get(k) == v for k, v in labels.items()):
            out[found["replica"]] = out.get(found["replica"], 0.0) + value
    return out


def serve_one_each(srv: KVServe) -> dict[str, float]:
    """One short request through the proxy, then the requests each replica has served."""
    r = httpx.post(f"{srv.url}/v1/completions", json={"model": "smollm2", "prompt": "Hi", "max_tokens": 1},
                   timeout=60)
    assert r.status_code == 200, r.text
    return by_replica(srv, "kvserve_request_success_total")


def stream_one(client: openai.OpenAI, i: int) -> str:
    chunks = client.completions.create(model="smollm2", prompt=f"Item {i}: a short story about", max_tokens=16,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    text, reason = "", None
    for c in chunks:
        text += c.choices[0].text
        reason = c.choices[0].finish_reason or reason
    assert reason == "length", reason
    return text


def test_32_streams_all_succeed_and_both_replicas_serve(ray_server):
    client = openai.OpenAI(base_url=f"{ray_server.url}/v1", api_key="none", max_retries=0, timeout=300)
    results: dict[int, object] = {}

    def worker(i: int) -> None:
        try:
            results[i] = stream_one(client, i)
        except Exception as exc:  # noqa: BLE001 - reported below
            results[i] = exc

    before = by_replica(ray_server, "kvserve_request_success_total", finished_reason="length")
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    failed = {i: r for i, r in results.items() if not isinstance(r, str)}
    assert len(results) == 32 and not failed, failed
    after = by_replica(ray_server, "kvserve_request_success_total", finished_reason="length")
    served = {rid: n - before.get(rid, 0.0) for rid, n in after.items()}
    assert len(served) == 2 and all(n > 0 for n in served.values()) and sum(served.values()) == 32, served
    used = wait_until(lambda: by_replica(ray_server, "kvserve_kv_cache_blocks_used"),
                      lambda u: len(u) == 2 and not any(u.values()), 30)
    assert len(used) == 2 and not any(used.values()), used


def test_a_killed_replica_is_replaced_while_the_other_serves(ray_server):
    before = replicas(ray_server)
    victim_id, victim = sorted(before.items())[0]
    client = openai.OpenAI(base_url=f"{ray_server.url}/v1", api_key="none", max_retries=0, timeout=300)
    log: list[tuple[float, bool, str]] = []  # (start time, ok, error)
    stop = threading.Event()

    def load(k: int) -> None:
        i = 0
        while not stop.is_set():
            start = time.monotonic()
            try:
                stream_one(client, 1000 * k + i)
                log.append((start, True, ""))
            except Exception as exc:  # noqa: BLE001 - counted below
                log.append((start, False, repr(exc)))
            i += 1

    threads = [threading.Thread(target=load, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    time.sleep(3)
    killed_at = time.monotonic()
    import os

    os.kill(victim["actor_pid"], signal.SIGKILL)
    after = wait_until(lambda: replicas(ray_server), lambda r: len(r) == 2 and victim_id not in r,
                       REPLACE_TIMEOUT, interval=1.0)
    replaced_at = time.monotonic()
    # Some load after the replacement: until a request started after it has finished.
    wait_until(lambda: any(start > replaced_at for start, _, _ in log), bool, REPLACE_TIMEOUT, interval=0.5)
    stop.set()
    for t in threads:
        t.join(300)
    assert len(after) == 2 and victim_id not in after, (before, after, ray_server.describe())
    late = [entry for entry in log if entry[0] > killed_at]
    assert late and all(ok for _, ok, _ in late), [e for e in late if not e[1]]
    assert any(start > replaced_at for start, _, _ in late)
    used = wait_until(lambda: by_replica(ray_server, "kvserve_kv_cache_blocks_used"),
                      lambda u: len(u) == 2 and not any(u.values()), 30)
    assert len(used) == 2 and not any(used.values()), used

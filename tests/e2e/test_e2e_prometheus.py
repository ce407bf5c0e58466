"""A real Prometheus, configured from docker/prometheus.yml, scrapes the real server.

Debian's ``prometheus`` package (2.42, with ``promtool``) provides the binaries;
``make test`` installs it where it may. A missing binary fails the test, with the
line ``make test`` prints when it cannot install it.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import yaml
from e2e_helpers import (
    MODEL,
    REPO,
    KVServe,
    Process,
    free_port,
    idle,
    metric,
    wait_until,
)

pytestmark = pytest.mark.slow

COMPOSE_CONFIG = REPO / "docker" / "prometheus.yml"
# The Makefile's PROMETHEUS_HINT, word for word.
PROMETHEUS_HINT = ("prometheus is not installed: run 'sudo apt-get install -y prometheus' "
                   "(tests/e2e/test_e2e_prometheus.py needs prometheus and promtool)")


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not on PATH. {PROMETHEUS_HINT}")
    return path


def local_config(source: dict[str, Any], target: str) -> dict[str, Any]:
    """docker/prometheus.yml's scrape job and metrics path, aimed at ``target``, every second."""
    [job] = source["scrape_configs"]
    fast = {"scrape_interval": "1s", "scrape_timeout": "1s"}
    return {
        "global": {**source.get("global", {}), **fast, "evaluation_interval": "1s"},
        "scrape_configs": [{**job, **fast, "static_configs": [{"targets": [target]}]}],
    }


def test_promtool_accepts_the_compose_config() -> None:
    r = subprocess.run([binary("promtool"), "check", "config", str(COMPOSE_CONFIG)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.fixture(scope="module")
def prometheus(server: KVServe, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Prometheus scraping the server every second; yields its base URL."""
    exe = binary("prometheus")
    tmp = tmp_path_factory.mktemp("prometheus")
    config = tmp / "prometheus.yml"
    config.write_text(yaml.safe_dump(
        local_config(yaml.safe_load(COMPOSE_CONFIG.read_text()), f"127.0.0.1:{server.port}")))
    check = subprocess.run([binary("promtool"), "check", "config", str(config)],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr

    port = free_port()
    proc = Process([exe, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}",
                    f"--web.listen-address=127.0.0.1:{port}"], tmp / "prometheus.log", "prometheus")
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_http_ok(f"{url}/-/ready", timeout=60)
        yield url
    finally:
        proc.stop(timeout=30)


def query(prometheus: str, expr: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=10.0)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "success", body
    return body["data"]["result"]


def test_prometheus_scrapes_the_server_counters(prometheus: str, server: KVServe,
                                                client: openai.OpenAI) -> None:
    for prompt in ("Hello,", "The weather today is"):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    samples = wait_until(server.metrics, idle, timeout=30.0)
    expected = metric(samples, "generation_tokens_total")
    assert expected > 0

    def scraped() -> list[dict[str, Any]]:
        return query(prometheus, "kvserve_generation_tokens_total")

    result = wait_until(scraped, lambda res: len(res) == 1 and float(res[0]["value"][1]) == expected,
                        timeout=30.0, interval=0.5)
    assert len(result) == 1, result
    [series] = result
    assert float(series["value"][1]) == expected
    [job] = yaml.safe_load(COMPOSE_CONFIG.read_text())["scrape_configs"]
    assert series["metric"]["job"] == job["job_name"]
    assert series["metric"]["instance"] == f"127.0.0.1:{server.port}"
    assert series["metric"]["model_name"] == MODEL
    # Polled: one scrape past its 1 s timeout on a loaded machine sets `up` to 0 until the next.
    ups = wait_until(lambda: query(prometheus, f'up{{job="{job["job_name"]}"}}'),
                     lambda res: len(res) == 1 and res[0]["value"][1] == "1", timeout=30.0, interval=0.5)
    assert [u["value"][1] for u in ups] == ["1"], ups


def test_the_hint_is_the_one_make_prints() -> None:
    makefile = (REPO / "Makefile").read_text()
    assert f"PROMETHEUS_HINT := {PROMETHEUS_HINT}\n" in makefile

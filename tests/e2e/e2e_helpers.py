"""Helpers for the end-to-end tests: real processes on free ports, /metrics parsing, polling.

NOTE: tests/ has no __init__.py, so pytest puts this directory on sys.path and
the e2e modules import this file by bare name (as tests/server does with
``api_helpers``).
"""

from __future__ import annotations

import ctypes
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import TypeVar

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[2]
MODEL = "smollm2"
ADAPTER = "sql"  # the LoRA adapter the shared server (conftest.server) serves beside the base model
# SmolLM2-135M's shape, for a LoRA adapter that fits it (the loader checks every tensor).
SMOLLM2_SHAPE = SimpleNamespace(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                                num_key_value_heads=3, head_dim=64, intermediate_size=1536)
# The ``kvserve`` console script that ``pip install -e .`` puts next to the interpreter.
KVSERVE = Path(sys.executable).with_name("kvserve")
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

T = TypeVar("T")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kvserve_argv(*args: str) -> list[str]:
    assert KVSERVE.exists(), f"{KVSERVE} is missing: install the project with `pip install -e .`"
    return [str(KVSERVE), *args]


def _term_with_parent() -> None:
    """In the child before it runs: SIGTERM when the test process dies (Linux's
    PR_SET_PDEATHSIG), so that a run killed mid-test (a CI timeout, a second ^C) leaves
    no server, rank or Ray replica behind to slow the next one down."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class Process:
    """A child process whose stdout and stderr go to a log file, shown when a test fails."""

    def __init__(self, argv: Sequence[str], log_path: Path, name: str) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, cwd=REPO, preexec_fn=_term_with_parent)

    def log(self, tail: int = 8000) -> str:
        text = self.log_path.read_text(errors="replace")
        return text[-tail:]

    def describe(self) -> str:
        return f"{self.name} ({' '.join(self.argv)}) log:\n{self.log()}"

    def wait_http_ok(self, url: str, timeout: float) -> None:
        """Poll ``url`` until it answers 200; fail (with the log) if the process exits first."""
        deadline = time.monotonic() + timeout
        while True:
            rc = self.proc.poll()
            if rc is not None:
                pytest.fail(f"{self.name} exited with {rc} before {url} answered; "
                            f"{self.describe()}")
            try:
                if httpx.get(url, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"{url} did not answer 200 within {timeout:.0f}s; {self.describe()}")
            time.sleep(0.25)

    def stop(self, timeout: float) -> int:
        """SIGTERM, then wait up to ``timeout`` seconds; fail (after a SIGKILL) if it hangs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"{self.name} did not exit within {timeout:.0f}s of SIGTERM; "
                        f"{self.describe()}")
        finally:
            self._log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class KVServe(Process):
    """A ``kvserve serve`` process on 127.0.0.1:``port``."""

    def __init__(self, port: int, log_path: Path, api_key: str | None, shutdown_timeout: float,
                 extra: Sequence[str] = (), dtype: str | None = "float32") -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.api_key = api_key
        self.shutdown_timeout = shutdown_timeout
        # dtype None: kvserve's own choice (--dtype and --quantization auto), as a user's plain
        # `kvserve serve`. Otherwise the path is pinned, so what the model writes does not hang on
        # which path a timing on a loaded machine picked (a CPU with AMX may pick w4a8 on AMX).
        pinned = ("--dtype", dtype, "--quantization", "w4a8") if dtype else ()
        argv = kvserve_argv("serve", "--model", MODEL, "--host", "127.0.0.1", "--port", str(port),
                            *pinned, "--kv-cache-memory", "256MiB",
                            "--max-model-len", "2048",
                            "--shutdown-timeout", str(shutdown_timeout), *extra)
        if api_key:
            argv += ["--api-key", api_key]
        super().__init__(argv, log_path, "kvserve serve")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def metrics(self) -> dict[tuple[str, frozenset], float]:
        """``/metrics`` parsed with prometheus_client's own parser: (sample name, labels) -> value."""
        r = httpx.get(f"{self.url}/metrics", timeout=10.0)
        assert r.status_code == 200, r.text
        return parse_metrics(r.text)


def parse_metrics(text: str) -> dict[tuple[str, frozenset], float]:
    out: dict[tuple[str, frozenset], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def metric(samples: dict[tuple[str, frozenset], float], name: str, **labels: str) -> float:
    """The one sample ``kvserve_<name>`` for the served model (and ``labels``)."""
    key = (f"kvserve_{name}", frozenset({"model_name": MODEL, **labels}.items()))
    assert key in samples, f"no sample {key}; have {sorted({k[0] for k in samples})}"
    return samples[key]


def wait_until(probe: Callable[[], T], done: Callable[[T], bool], timeout: float,
               interval: float = 0.1) -> T:
    """Call ``probe`` until ``done(result)`` or ``timeout`` seconds pass; the last result."""
    deadline = time.monotonic() + timeout
    while True:
        result = probe()
        if done(result) or time.monotonic() > deadline:
            return result
        time.sleep(interval)


def idle(samples: dict[tuple[str, frozenset], float]) -> bool:
    return (metric(samples, "num_requests_running") == 0
            and metric(samples, "num_requests_waiting") == 0
            and metric(samples, "kv_cache_blocks_used") == 0)


"""What one run of the load generator (``bench.serve``) sends: ``BenchConfig``,
validated where it is built, and the loopback check that keeps the load on this machine."""

from __future__ import annotations

import ipaddress
import math
import secrets
import socket
from dataclasses import dataclass, field
from typing import Any

import httpx

STRUCTURED = ("json",)
# --goodput's limits (ms): time to first token, time per output token, end-to-end latency.
SLO_KEYS = ("ttft", "tpot", "e2el")
LOADS = ("random", "quote", "code")


@dataclass
class BenchConfig:
    """What one benchmark run sends (everything but the concurrency levels)."""

    url: str = "http://127.0.0.1:8000"
    model: str | None = None          # None: the first model of GET /v1/models
    input_len: int = 128
    output_len: int = 128
    seed: int = 0
    ignore_eos: bool = False
    temperature: float = 0.0
    api_key: str | None = None
    request_timeout: float = 600.0    # seconds, per request
    max_duration: float = 3600.0      # seconds, per level; later requests are not sent
    warmup: int = 1                   # unmeasured requests before the first level
    words_per_token: float = 0.75     # prompt sizing when the server has no /tokenize
    progress: bool = True
    structured: str | None = None     # "json": every request constrained to BENCH_SCHEMA
    load: str = "random"              # LOADS: random-tag prompts, or paragraphs to quote
    burstiness: float = 1.0           # --request-rate arrivals: gamma shape (1: Poisson)
    goodput: dict[str, float] = field(default_factory=dict)  # SLO_KEYS -> limit in ms
    # Fields merged into every request's body last (a sampler's settings, say): they win.
    extra_body: dict[str, Any] = field(default_factory=dict)
    run_id: str = field(default_factory=lambda: secrets.token_hex(8))

    def __post_init__(self) -> None:
        for name in ("input_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.structured not in (None, *STRUCTURED):
            raise ValueError(f"structured must be one of {', '.join(STRUCTURED)}, got {self.structured!r}")
        if self.load not in LOADS:
            raise ValueError(f"load must be one of {', '.join(LOADS)}, got {self.load!r}")
        if self.request_timeout <= 0 or self.max_duration <= 0:
            raise ValueError("request_timeout and max_duration must be positive")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError(f"burstiness must be a positive number, got {self.burstiness}")
        for key, limit in self.goodput.items():
            if key not in SLO_KEYS or not limit > 0:
                raise ValueError(f"goodput limits are {', '.join(SLO_KEYS)} with a positive number of ms, "
                                 f"got {key}:{limit}")
        check_loopback(self.url)

    @property
    def base(self) -> str:
        return self.url.rstrip("/").removesuffix("/v1")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def check_loopback(url: str) -> None:
    """``ValueError`` unless ``url`` is http(s) to a host that resolves only to loopback."""
    parsed = httpx.URL(url)
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"--url must be http(s)://HOST[:PORT], got {url!r}")
    try:
        infos = socket.getaddrinfo(parsed.host, parsed.port or 80, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(f"cannot resolve {parsed.host!r}: {e}") from None
    addrs = {ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos}
    if not addrs or not all(a.is_loopback for a in addrs):
        raise ValueError(f"{parsed.host!r} is not a loopback address: the load generator only "
                         "targets servers on this machine (127.0.0.0/8, ::1, localhost)")

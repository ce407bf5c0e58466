"""Latency and throughput summaries of one load level, and their table."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class RequestResult:
    """One streamed completion as the client saw it (times in seconds)."""

    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0                 # request sent -> first chunk with text
    e2e: float = 0.0                  # request sent -> end of stream
    itl: list[float] = field(default_factory=list)  # gaps between text chunks
    usage_reported: bool = False      # output_tokens came from the server's ``usage``
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None for a one-token answer."""
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation, as numpy's default."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _dist_ms(values: Sequence[float]) -> dict[str, float]:
    ms = [v * 1000.0 for v in values]
    return {"mean": sum(ms) / len(ms) if ms else math.nan,
            "p50": percentile(ms, 50), "p99": percentile(ms, 99)}


def meets(result: RequestResult, slos: dict[str, float]) -> bool:
    """Whether a completed request kept within every limit of ``slos`` (ms): ``ttft``,
    ``tpot`` (a one-token answer has none, and meets it) and ``e2el``."""
    got = {"ttft": result.ttft, "tpot": result.tpot, "e2el": result.e2e}
    return result.ok and all(got[k] is None or got[k] * 1000.0 <= limit for k, limit in slos.items())


def summarize(results: Sequence[RequestResult], duration: float, concurrency: int | None,
              not_sent: int = 0, slos: dict[str, float] | None = None) -> dict:
    """The level's numbers, JSON-ready: counts, throughput, and mean/p50/p99 in ms
    of TTFT, TPOT, ITL (all gaps of all requests) and end-to-end latency; with
    ``slos``, ``request_goodput``: the requests per second that ``meets`` them."""
    good = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in good)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    per_s = (lambda n: n / duration) if duration > 0 else (lambda n: math.nan)
    return {
        "concurrency": concurrency,
        "num_prompts": len(results) + not_sent,
        "completed": len(good),
        "failed": len(results) - len(good),
        "not_sent": not_sent,
        "duration_s": duration,
        "input_tokens": sum(r.prompt_tokens for r in good),
        "output_tokens": out_tokens,
        "usage_reported": bool(good) and all(r.usage_reported for r in good),
        "request_throughput": per_s(len(good)),
        "output_throughput": per_s(out_tokens),
        "ttft_ms": _dist_ms([r.ttft for r in good]),
        "tpot_ms": _dist_ms([t for r in good if (t := r.tpot) is not None]),
        "itl_ms": _dist_ms([gap for r in good for gap in r.itl]),
        "e2e_ms": _dist_ms([r.e2e for r in good]),
        "errors": errors,
        **({"request_goodput": per_s(sum(meets(r, slos) for r in good))} if slos else {}),
    }


_COLUMNS = ("concurrency", "ok", "failed", "duration s", "req/s", "output tok/s",
            "TTFT mean ms", "TTFT p50", "TTFT p99", "TPOT mean ms", "TPOT p50", "TPOT p99",
            "ITL mean ms", "ITL p50", "ITL p99", "E2E mean ms", "E2E p50", "E2E p99")


def _load(s: dict) -> str:
    """A level's load: its concurrency, or its request rate (and cap)."""
    if "request_rate" not in s:
        return str(s["concurrency"])
    rate = s["request_rate"]
    cap = f" (max {s['concurrency']})" if s["concurrency"] else ""
    return (f"{rate:g}/s" if isinstance(rate, (int, float)) else f"{rate}/s") + cap


def _row(s: dict) -> list[str]:
    cells = [_load(s), str(s["completed"]), str(s["failed"] + s["not_sent"]),
             f"{s['duration_s']:.1f}", f"{s['request_throughput']:.2f}",
             f"{s['output_throughput']:.1f}"]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        cells += [f"{s[key][q]:.1f}" for q in ("mean", "p50", "p99")]
    return cells


def format_table(levels: Sequence[dict]) -> str:
    """A markdown table, one row per level (``failed`` includes requests not sent)."""
    first = "request rate" if any("request_rate" in s for s in levels) else _COLUMNS[0]
    columns = (first,) + _COLUMNS[1:]
    lines = ["| " + " | ".join(columns) + " |",
             "|" + "|".join("---:" for _ in _COLUMNS) + "|"]
    lines += ["| " + " | ".join(_row(s)) + " |" for s in levels]
    return "\n".join(lines)

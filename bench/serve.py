"""Load generator for any OpenAI-compatible server: streaming ``/v1/completions``.

For each concurrency level, ``--num-prompts`` requests go out with at most
``concurrency`` in flight (closed loop: a finished request makes room for the
next). Each prompt opens with a random tag drawn from the seed, a per-run
nonce and the prompt's index, so no server can answer it from a prompt cache
filled by an earlier run or level. Prompts are trimmed to ``--input-len``
tokens with the server's ``/tokenize`` + ``/detokenize`` (vLLM/kvserve or
llama-server shapes), else sized with a words-per-token ratio.

    kvserve bench serve --url http://127.0.0.1:8000 --concurrency 1 4 16 64 \\
        --input-len 128 --output-len 128 --ignore-eos --json out.json

Reported per level: requests completed and failed, duration, request/s,
output tokens/s, and mean/p50/p99 of time to first token (TTFT), time per
output token after the first (TPOT), inter-token latency (ITL, the gaps
between streamed chunks) and end-to-end latency, in ms. Output tokens are the
``usage`` the server reports at the end of the stream
(``stream_options.include_usage``), else the number of chunks with text.

``--structured json`` sends every request with ``response_format`` set to a
fixed JSON Schema (``BENCH_SCHEMA``: nested objects, enums, an array of at
least 12 objects), so each answer is constrained for all its tokens and runs
to ``--output-len`` like an unconstrained one with ``--ignore-eos``.

``--request-rate R [R ...]`` sends open-loop load instead, as vLLM's
benchmark does: each rate is a level whose requests arrive at ``R`` per
second on average, their gaps drawn from a gamma distribution of shape
``--burstiness`` (1: a Poisson process; below 1 burstier, above 1 steadier),
whether or not earlier answers have come back; ``inf`` sends them all at
once. ``--max-concurrency N`` caps the requests in flight (an arrival past
the cap waits for a place; its latencies count from when it is sent).

``--goodput ttft:MS tpot:MS e2el:MS`` (any of them) adds, per level, the
requests per second that completed within every one of those limits.

``--load quote`` (where prompt lookup pays): each prompt asks for a paragraph
to be rewritten with its typos fixed; the paragraph is a slice of
bench/data/quality_text.txt with a few letters swapped, so a good answer
quotes most of the prompt. ``--load code`` (the same, for code): each prompt
asks for a slice of bench/data/edit_source.py (an original file) to be given back
with one name renamed. ``--load random`` (the default) is the random-tag load
above.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from typing import Any

import httpx

from bench.serve_config import LOADS, SLO_KEYS, STRUCTURED, BenchConfig, check_loopback
from bench.serve_load import run, run_async
from bench.stats import format_table

# What other benchmarks import from here (the pieces live in bench.serve_config,
# bench.serve_prompts and bench.serve_load).
__all__ = ["BenchConfig", "build_parser", "check_loopback", "main", "report_text", "run", "run_async"]


def report_text(report: dict) -> str:
    """The header line and the table that ``main`` prints."""
    c = report["config"]
    head = (f"{report['url']}  model {report['model']}  {c['input_len']} input tokens "
            f"(tokenizer: {report['tokenizer']}) -> {c['output_len']} output tokens"
            f"{' (ignore_eos)' if c['ignore_eos'] else ''}, temperature {c['temperature']}"
            f"{', structured: ' + c['structured'] if c.get('structured') else ''}"
            f"{', load: ' + c['load'] if c.get('load', 'random') != 'random' else ''}")
    text = head + "\n\n" + format_table(report["levels"])
    if c.get("goodput"):
        limits = ", ".join(f"{k} <= {v:g} ms" for k, v in c["goodput"].items())
        text += "\n\ngoodput (" + limits + "): " + ", ".join(
            f"{s['request_goodput']:.2f} req/s" for s in report["levels"])
    return text


def build_parser(prog: str = "python -m bench.serve") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = BenchConfig.__dataclass_fields__
    p.add_argument("--url", default=d["url"].default, help="server base URL (loopback only)")
    p.add_argument("--model", default=None, help="model name (default: ask /v1/models)")
    p.add_argument("--concurrency", type=int, nargs="+", default=None, metavar="N",
                   help="one or several levels of requests in flight, e.g. 1 4 16 64 (default 1)")
    p.add_argument("--request-rate", type=float, nargs="+", default=None, metavar="R",
                   help="open-loop levels instead: requests arrive at R per second (inf: all at once), "
                        "see --burstiness")
    p.add_argument("--burstiness", type=float, default=d["burstiness"].default,
                   help="with --request-rate: the gamma shape of the gaps between arrivals "
                        "(1: Poisson; lower: burstier)")
    p.add_argument("--max-concurrency", type=int, default=None, metavar="N",
                   help="with --request-rate: at most N requests in flight")
    p.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS",
                   help="also report the requests per second that met every limit: ttft:MS, tpot:MS, e2el:MS")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="requests per level (default max(16, 4 x concurrency))")
    p.add_argument("--input-len", type=int, default=d["input_len"].default)
    p.add_argument("--output-len", type=int, default=d["output_len"].default,
                   help="max_tokens of each request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos: true so every answer has --output-len tokens")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--api-key", default=os.environ.get("KVSERVE_API_KEY"))
    p.add_argument("--request-timeout", type=float, default=d["request_timeout"].default)
    p.add_argument("--max-duration", type=float, default=d["max_duration"].default,
                   help="seconds per level; requests not sent by then count as failed")
    p.add_argument("--warmup", type=int, default=d["warmup"].default)
    p.add_argument("--structured", choices=STRUCTURED, default=None,
                   help="constrain every answer: json = response_format with a fixed JSON Schema")
    p.add_argument("--load", choices=LOADS, default="random",
                   help="random: random-tag prompts; quote: paragraphs the answer must rewrite; code: "
                        "code the answer must give back with a name renamed (both where speculation pays)")
    p.add_argument("--extra-body", type=_json_object, default={}, metavar="JSON",
                   help="fields merged into every request's body, e.g. '{\"dry_multiplier\": 0.8}' "
                        "(they win over the bench's own)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the report here")
    p.add_argument("--no-progress", action="store_true")
    return p


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def main(argv: list[str] | None = None, prog: str = "python -m bench.serve") -> int:
    # httpx logs every request at INFO (``kvserve bench`` logs at INFO): the table is the report.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.num_prompts is not None and args.num_prompts < 1:
        parser.error("--num-prompts must be at least 1")
    if args.request_rate is not None:
        if args.concurrency is not None:
            parser.error("--request-rate levels take --max-concurrency, not --concurrency")
        if min(args.request_rate) <= 0 or any(math.isnan(r) for r in args.request_rate):
            parser.error("--request-rate must be positive (inf: all at once)")
        levels = [args.max_concurrency] if args.max_concurrency is not None else []
    elif args.max_concurrency is not None:
        parser.error("--max-concurrency goes with --request-rate (closed-loop levels are --concurrency)")
    else:
        levels = args.concurrency or [1]
    if levels and min(levels) < 1:
        parser.error("--concurrency levels must be at least 1")
    goodput: dict[str, float] = {}
    for item in args.goodput:
        key, _, value = item.partition(":")
        try:
            goodput[key] = float(value)
        except ValueError:
            parser.error(f"--goodput takes KEY:MS ({', '.join(SLO_KEYS)}), got {item!r}")
    try:
        cfg = BenchConfig(url=args.url, model=args.model, input_len=args.input_len,
                          output_len=args.output_len, seed=args.seed, ignore_eos=args.ignore_eos,
                          temperature=args.temperature, api_key=args.api_key,
                          request_timeout=args.request_timeout, max_duration=args.max_duration,
                          warmup=args.warmup, progress=not args.no_progress, structured=args.structured,
                          load=args.load, burstiness=args.burstiness, goodput=goodput,
                          extra_body=args.extra_body)
    except ValueError as e:
        parser.error(str(e))
    try:
        report = run(cfg, levels, args.num_prompts, request_rates=args.request_rate)
    except httpx.HTTPError as e:
        print(f"{prog}: error: cannot reach {cfg.url}: {e!r}", file=sys.stderr)
        return 1
    print(report_text(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if all(s["completed"] for s in report["levels"]) else 1


if __name__ == "__main__":
    sys.exit(main())

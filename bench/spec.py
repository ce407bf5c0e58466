"""Speculative decoding on a real model: each method's output speed and acceptance, per load.

    python -m bench.spec --model qwen2.5-coder-1.5b --draft-model qwen2.5-coder-0.5b

For each method (none, ``--speculative ngram``, ``--speculative draft --draft-model M``) a
kvserve server is started alone on the machine and loaded by ``bench.serve`` with the
quote load (a paragraph to give back with its typos fixed) and the code load (code to
give back with one name renamed), greedy, at each ``--levels`` concurrency. Speed is the
output tokens/s and mean TPOT; acceptance is read from the server's Prometheus counters
(accepted / proposed tokens, and accepted tokens per step that ran proposals) over each
load. Prints a markdown table and writes the JSON to ``bench/results/spec-<time>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import re
import shlex
import sys
from pathlib import Path

import httpx

from bench.peers import REPO, _kvserve_argv, free_port, server
from bench.serve import BenchConfig, run_async

LOADS = ("quote", "code")
COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")


def counters(url: str) -> dict[str, float]:
    """The speculation counters of ``url``'s /metrics (zero before the first proposal)."""
    text = httpx.get(url + "/metrics", timeout=10.0, trust_env=False).text
    found = {}
    for name in COUNTERS:
        m = re.search(rf"^(?:kvserve_|vllm:)?{name}(?:_total)?(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M)
        found[name] = float(m.group(1)) if m else 0.0
    return found


def methods(draft_model: str | None) -> list[tuple[str, list[str]]]:
    """(name, extra serve flags) of each method measured."""
    out = [("none", []), ("ngram", ["--speculative", "ngram"])]
    if draft_model:
        out.append((f"draft {draft_model}", ["--speculative", "draft", "--draft-model", draft_model]))
    return out


def run(model: str, method: list[str], levels: list[int], num_prompts: int, input_len: int, output_len: int,
        log: Path, extra: list[str]) -> list[dict]:
    """Every load at every level on one server: rows of the report."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    rows = []
    with server([*_kvserve_argv(port), "--model", model, *method, *extra], url + "/health", log):
        for load in LOADS:
            before = counters(url)
            cfg = BenchConfig(url=url, input_len=input_len, output_len=output_len, load=load, progress=False)
            report = asyncio.run(run_async(cfg, levels, num_prompts))
            after = counters(url)
            drafts, proposed, accepted = (after[k] - before[k] for k in COUNTERS)
            for level in report["levels"]:
                rows.append({"load": load, "concurrency": level["concurrency"],
                             "output_tok_s": level["output_throughput"],
                             "tpot_ms": level["tpot_ms"]["mean"], "ttft_ms": level["ttft_ms"]["mean"],
                             "completed": level["completed"],
                             "acceptance": accepted / proposed if proposed else None,
                             "accepted_per_step": accepted / drafts if drafts else None})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.spec", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the target model (a name or a file)")
    p.add_argument("--draft-model", default=None, help="a draft model for --speculative draft")
    p.add_argument("--levels", type=int, nargs="+", default=[1, 4])
    p.add_argument("--num-prompts", type=int, default=8, help="requests per level")
    p.add_argument("--input-len", type=int, default=200)
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--kvserve-args", default="", help="more `kvserve serve` flags for every method")
    p.add_argument("--results-dir", type=Path, default=REPO / "bench" / "results")
    args = p.parse_args(argv)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    report = {"command": " ".join(["python -m bench.spec", *(argv if argv is not None else sys.argv[1:])]),
              "time": stamp, "model": args.model, "methods": {}}
    for name, flags in methods(args.draft_model):
        log = args.results_dir / "logs" / f"spec-{stamp}-{name.split()[0]}.log"
        report["methods"][name] = run(args.model, flags, args.levels, args.num_prompts, args.input_len,
                                      args.output_len, log, shlex.split(args.kvserve_args))
    print(format_report(report))
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / f"spec-{stamp}.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


def format_report(report: dict) -> str:
    """The markdown table: per method, load and level, speed against no speculation's."""
    base = {(r["load"], r["concurrency"]): r["output_tok_s"] for r in report["methods"].get("none", [])}
    lines = ["| method | load | streams | output tok/s | vs none | mean TPOT ms | mean TTFT ms | acceptance | "
             "accepted per step |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, rows in report["methods"].items():
        for r in rows:
            ref = base.get((r["load"], r["concurrency"]))
            ratio = f"{r['output_tok_s'] / ref:.2f}x" if ref else "-"
            acc = "-" if r["acceptance"] is None else f"{100 * r['acceptance']:.0f}%"
            per = "-" if r["accepted_per_step"] is None else f"{r['accepted_per_step']:.2f}"
            lines.append(f"| {name} | {r['load']} | {r['concurrency']} | {r['output_tok_s']:.1f} | {ratio} | "
                         f"{r['tpot_ms']:.1f} | {r['ttft_ms']:.0f} | {acc} | {per} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())

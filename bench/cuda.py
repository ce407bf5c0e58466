"""The CUDA path, checked and measured in one short run (for a machine with a GPU).

    python -m bench.cuda --out DIR                      # the default model's GGUF
    python -m bench.cuda --model PATH.gguf --out DIR    # a GGUF copied to the machine

CI never has a GPU, so this is run by hand where one is lent. Each stage runs on
its own (a failure is recorded with its traceback and the next stage goes on) and
writes what it found to ``DIR/cuda.json``:

1. ``info``: torch, CUDA, the GPU.
2. ``greedy``: kvserve's greedy tokens on CUDA in float32, batched, against
   transformers' on CUDA (the same GGUF, float32, each prompt alone); and kvserve's
   default CUDA dtype (bfloat16) against float32.
3. ``batched``: whether a prompt's greedy tokens on CUDA are the same alone and
   beside seven others (not promised on CUDA; recorded).
4. ``profile``: one sequence's decode step, timed, and under torch.profiler its
   kernel launches and GPU time (the top ops in ``DIR/profile.txt``).
5. ``serve``: ``kvserve serve --device cuda`` under ``bench.serve``'s load
   (128-token prompts, 128 output tokens, ignore_eos) with the CPU-sized defaults
   and with each ``--budget`` given (``TOKENS:SEQS:KV_GIB``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

from bench.offline import make_prompts
from bench.peers import free_port, server
from bench.serve import BenchConfig, report_text, run

GREEDY_TOKENS = 48


def _info(device: str) -> dict:
    out = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()}
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        out.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                   memory_gib=round(props.total_memory / 2**30, 1),
                   bf16=torch.cuda.is_bf16_supported())
    return out


def _engine(model: str, device: str, dtype: str, **kw):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=model, device=device, dtype=dtype, **kw))


def _greedy(engine, prompts: list[list[int]], n: int = GREEDY_TOKENS) -> list[list[int]]:
    from engine.sampling_params import SamplingParams

    results = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                              use_tqdm=False)
    return [list(r[0].token_ids) for r in results]


def _agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """How many sequences are equal, and where each unequal one first differs."""
    first = [next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), None) for s, t in zip(a, b)]
    return {"equal": sum(f is None for f in first), "of": len(a),
            "first_difference": [f for f in first if f is not None]}


def _reference_greedy(model: str, device: str, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    path = Path(model)
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                               dtype=torch.float32).to(device).eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            gen = ref.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                               max_new_tokens=GREEDY_TOKENS, min_new_tokens=GREEDY_TOKENS,
                               do_sample=False, pad_token_id=0)
            out.append(gen[0, len(p):].tolist())
    del ref
    return out


def stage_greedy(args, prompts) -> dict:
    cuda32 = _engine(args.model, args.device, "float32")
    ours = _greedy(cuda32, prompts)
    del cuda32
    res = {"kvserve_cuda_fp32_vs_transformers_cuda_fp32": _agreement(ours, _reference_greedy(
        args.model, args.device, prompts))}
    auto = _engine(args.model, args.device, "auto")
    res["default_dtype"] = str(auto.runner.dtype)
    res["kvserve_cuda_auto_vs_cuda_fp32"] = _agreement(_greedy(auto, prompts), ours)
    return res


def stage_batched(args, prompts) -> dict:
    res = {}
    for dtype in ("float32", "auto"):
        engine = _engine(args.model, args.device, dtype)
        alone = [_greedy(engine, [p])[0] for p in prompts[:2]]
        together = _greedy(engine, prompts[:8])[:2]
        res[dtype] = _agreement(alone, together)
        del engine
    return res


def stage_profile(args, prompts) -> dict:
    """One sequence's decode step: timed (20 steps), and under torch.profiler (5 steps) its
    kernel launches and GPU time."""
    from torch.profiler import ProfilerActivity, profile

    from engine.sampling_params import SamplingParams

    engine = _engine(args.model, args.device, "auto")
    engine.add_request("profiled", prompts[0], SamplingParams(temperature=0, max_tokens=80, ignore_eos=True))
    for _ in range(8):  # the prompt and a few decodes: warm
        engine.step()
    cuda = args.device.startswith("cuda")
    steps = 20
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    if cuda:
        torch.cuda.synchronize()
    res = {"step_ms": round((time.perf_counter() - t0) / steps * 1e3, 2)}
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(5):
            engine.step()
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
    res["kernel_launches_per_step"] = sum(
        e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx")) / 5
    res["gpu_ms_per_step"] = round(sum(e.self_device_time_total for e in events) / 5 / 1e3, 2) if cuda else None
    Path(args.out, "profile.txt").write_text(events.table(sort_by="self_cpu_time_total", row_limit=25))
    engine.abort_request("profiled")
    return res


def stage_serve(args) -> dict:
    from bench.peers import _kvserve_argv

    res = {}
    for budget in [None, *args.budget]:
        port = free_port()
        argv = [*_kvserve_argv(port), "--model", args.model, "--device", args.device]
        if budget:
            tokens, seqs, kv = budget.split(":")
            argv += ["--max-num-batched-tokens", tokens, "--max-num-seqs", seqs,
                     "--kv-cache-memory", f"{kv}GiB"]
        name = budget or "defaults"
        log = Path(args.out) / f"serve-{name.replace(':', '_')}.log"
        levels = {}
        with server(argv, f"http://127.0.0.1:{port}/ready", log):
            cfg = BenchConfig(url=f"http://127.0.0.1:{port}", ignore_eos=True, progress=False,
                              max_duration=args.level_seconds, warmup=2)
            for level in args.levels:
                report = run(cfg, [level], num_prompts=max(8, 2 * level))
                print(report_text(report), flush=True)
                levels[level] = report["levels"][0]
        res[name] = levels
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cuda", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a GGUF file (default: the default model's)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=".")
    p.add_argument("--stages", nargs="+", default=["info", "greedy", "batched", "profile", "serve"])
    p.add_argument("--levels", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--level-seconds", type=float, default=45.0,
                   help="at most this long per load level (later requests are not sent)")
    p.add_argument("--budget", nargs="*", default=["2048:256:16"],
                   help="TOKENS:SEQS:KV_GIB server settings to measure beside the defaults")
    args = p.parse_args(argv)
    if args.model is None:
        from models.loader import resolve_model_path
        args.model = str(resolve_model_path("smollm2"))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    from engine.config import EngineConfig  # noqa: F401 (fail here, not in a stage, if the engine cannot import)

    prompts = None
    results: dict = {"argv": sys.argv[1:], "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    for stage in args.stages:
        t0 = time.perf_counter()
        try:
            if stage == "info":
                results[stage] = _info(args.device)
            elif stage == "serve":
                results[stage] = stage_serve(args)
            else:
                if prompts is None:
                    from models.gguf_loader import open_gguf
                    from models.tokenizer import Tokenizer
                    tok = Tokenizer.from_gguf_fields(open_gguf(args.model).fields)
                    prompts = make_prompts(tok, 8, 64, seed=0)
                run_stage = {"greedy": stage_greedy, "batched": stage_batched, "profile": stage_profile}[stage]
                results[stage] = run_stage(args, prompts)
        except Exception:  # noqa: BLE001 (a stage's failure is a finding: record it, go on)
            results[stage] = {"error": traceback.format_exc()}
        results.setdefault("seconds", {})[stage] = round(time.perf_counter() - t0, 1)
        print(f"== {stage} ({results['seconds'][stage]} s)\n"
              f"{json.dumps(results[stage], indent=1)[:3000]}", flush=True)
        Path(args.out, "cuda.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())

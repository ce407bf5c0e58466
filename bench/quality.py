"""What each run path costs in accuracy, measured against the float model, beside llama.cpp.

    python -m bench.quality                 # every path, then llama.cpp on the same file and text
    python -m bench.quality --no-llama-cpp  # kvserve's paths only
    python -m bench.quality --no-llama-cpp --activation-spans 16 32 row  # w4a8 with coarser scales
    python -m bench.quality --model qwen2.5-coder-1.5b --paths default --max-windows 6
                                            # a bigger model: the exact and default paths only

Teacher-forced over ``bench/data/quality_text.txt`` (an original text of
about 4,700 words that ships with the repo), the way ``llama-perplexity``
scores a file: the tokens in windows of ``--ctx`` (512), each window run
from an empty cache, and the second half of each window scored (every
position predicting the next token, so each has at least ctx/2 tokens of
context); ``--max-windows N`` scores only the first N windows, in both
engines. For each of kvserve's paths: perplexity, and against the exact
path (float32 activations, dense weights, float32 KV cache: the GGUF's own
weights computed in float32) the mean and 99th percentile of the
per-token KL divergence KL(float || path) and how often the two agree on
the top token. Beside them, llama.cpp's ``llama-perplexity
--kl-divergence`` on the same GGUF and text (built by ``bench.llama_cpp``),
against its own float32 run of the same weights (``llama-quantize
--allow-requantize ... F32``): the same figures, each engine measured
against its own exact path. Prints a markdown table, the row of the path
``kvserve serve`` picks with no flags marked, and writes the JSON to
``bench/results/quality-<time>.json`` (``quality-<time>-<file>.json`` for
another ``--model``).

``--model NAME|FILE``: the default model (``smollm2``), a fetched catalog
model (``kvserve fetch NAME``), a ``.gguf`` file or a Hugging Face directory
(llama.cpp needs a ``.gguf``), resolved as ``kvserve serve --model`` resolves
it. ``--paths`` chooses the paths: ``all`` (the default: every path below that
this CPU runs), ``default`` (what ``kvserve serve`` picks with no flags here:
``--dtype``/``--quantization auto`` as ``models.autotune`` resolves them, and
the KV cache dtype ``auto`` gives, e.g. float32 + ``w4a16`` and a float16 cache
on a CPU with AMX-BF16, each GGUF tensor at its own type), or
``DTYPE/QUANTIZATION/KV`` (``float32/w4a8/float16``). The exact path is always
scored first: it is the reference.

``--activation-spans`` adds ``w4a8`` with its activations rounded to int8
with one scale per that many inputs (the kernels use 16; ``row``: one per
input row) as the kernel rounds them, the products in float64
(``CoarseActivations``): what a coarser scale, which would let AMX keep its
sums in the tiles for longer, costs.
"""
from __future__ import annotations

import argparse
import datetime
import json
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench import llama_cpp
from models import ops
from models.loader import DEFAULT_MODEL
from models.quant import QuantizedLinear

REPO = Path(__file__).resolve().parents[1]
TEXT = REPO / "bench" / "data" / "quality_text.txt"
BLOCK_SIZE = 16

# (dtype, quantization, KV cache dtype); the first is the exact reference.
REFERENCE = ("float32", "none", "float32")
PATHS = [
    REFERENCE,
    ("float32", "w4a8", "float16"),
    ("float32", "w4a8", "int8"),
    ("float32", "int4", "float16"),
    ("float32", "none", "float16"),
    ("bfloat16", "w4a8", "bfloat16"),
    ("bfloat16", "int4", "bfloat16"),
    ("bfloat16", "none", "bfloat16"),
]
# Run only where the CPU has AMX-BF16.
AMX_BF16_PATHS = [("float32", "amx-bf16", "float16"), ("float32", "w4a16", "float16")]
DTYPES = ("float32", "bfloat16")
KV_DTYPES = ("float32", "float16", "bfloat16", "int8")


class CoarseActivations(torch.nn.Module):
    """A ``w4a8`` projection computed as its kernel computes it, in float64, with the
    activations rounded to int8 with one scale per ``span`` inputs (0: the whole row).

    Per group of 32 inputs the kernel computes ``d * sum((u - c) * xq) + (m + c d) * sum(x)``
    (grouped_gemm.cpp), ``xq`` being x rounded with one scale per 16 inputs: with
    ``span`` 16 this gives the kernel's results up to the order of its float sums
    (the rounding is the kernel's, as tests/models/test_quant.py's
    ``int8_activation_product`` defines it).
    """

    def __init__(self, layer: QuantizedLinear, span: int) -> None:
        super().__init__()
        codes, scales = layer.codes, layer.group_scales
        tiles, groups, words, _ = codes.shape
        if words == 4:  # 4-bit: nibbles of inputs 0..15 (low) and 16..31 (high), quant.pack_int4's order
            c = codes.reshape(tiles, groups, 4, 16, 4).permute(0, 3, 1, 2, 4)
            u, centre = torch.stack([c & 0xF, c >> 4], dim=3), 8.0
        else:  # 8-bit: quant.pack_int8's order
            u, centre = codes.reshape(tiles, groups, 8, 16, 4).permute(0, 3, 1, 2, 4), 128.0
        u = u.reshape(tiles * 16, groups * 32).double()
        d = scales[:, :, 0, :].permute(0, 2, 1).reshape(tiles * 16, groups).double()
        m = scales[:, :, 1, :].permute(0, 2, 1).reshape(tiles * 16, groups).double()
        self.centred = d.repeat_interleave(32, dim=1) * (u - centre)  # [N padded, K]
        self.offset = m + centre * d  # [N padded, groups]
        self.out_features, self.span, self.bias = layer.out_features, span, layer.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, k = x.shape
        span = self.span or k
        # Rounded as quantize_rows rounds, in float32: q = nearest(x * (127 / amax)), ties to
        # even, then dx = amax / 127 (a true division: torch's 127 / amax would be
        # amax.reciprocal() * 127, an ulp off now and then, which can round a code the other way).
        xs = x.float().reshape(t, k // span, span)
        amax = xs.abs().amax(-1, keepdim=True)
        inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
        xq = torch.round(xs * inv).double() * (amax / 127).double()
        y = xq.reshape(t, k) @ self.centred.T + x.double().reshape(t, k // 32, 32).sum(-1) @ self.offset.T
        y = y[:, :self.out_features].to(x.dtype)
        return y if self.bias is None else y + self.bias


def coarsen_activations(model: torch.nn.Module, span: int) -> None:
    """Swap every int8-activation projection of ``model`` for ``CoarseActivations`` (the
    layers then run op by op: the fused layer kernel takes only kvserve's own projections)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, QuantizedLinear) and child.int8_activations:
                setattr(parent, name, CoarseActivations(child, span))


def path_name(path: tuple) -> str:
    name = f"{path[0]} + {path[1]}, {path[2]} KV cache"
    if len(path) > 3:
        name += f", activations rounded per {path[3] or 'row'}{' inputs' if path[3] else ''} (emulated)"
    return name


@dataclass
class Quality:
    """One path's figures over the scored tokens."""

    name: str
    perplexity: float
    mean_kld: float | None  # against the engine's own exact path; None for the reference itself
    p99_kld: float | None
    same_top: float | None  # fraction of scored tokens whose top token agrees with the exact path's
    tokens: int
    seconds: float


def windows(ids: list[int], ctx: int) -> list[list[int]]:
    """Whole ``ctx``-token windows, back to back (a trailing partial one is dropped, as llama.cpp does)."""
    return [ids[i:i + ctx] for i in range(0, len(ids) - ctx + 1, ctx)]


def select_paths(specs: list[str], default: tuple[str, str, str], spans: list[int] = (),
                 amx_bf16: bool = False) -> list[tuple]:
    """The paths to score, the exact reference first, each once, in the order asked.

    ``specs``: ``all`` (``PATHS``, and ``AMX_BF16_PATHS`` where ``amx_bf16``), ``default``
    (the path ``default``, what ``kvserve serve`` picks with no flags) or
    ``DTYPE/QUANTIZATION/KV``; ``spans``: ``w4a8`` with coarser activation scales, appended.
    """
    paths: list[tuple] = [REFERENCE]
    for spec in specs:
        if spec == "all":
            paths += PATHS + (AMX_BF16_PATHS if amx_bf16 else [])
        elif spec == "default":
            paths.append(tuple(default))
        else:
            parts = tuple(spec.split("/"))
            if len(parts) != 3 or parts[0] not in DTYPES or parts[2] not in KV_DTYPES or not parts[1]:
                raise ValueError(f"path {spec!r}: use all, default or DTYPE/QUANTIZATION/KV with DTYPE one of "
                                 f"{', '.join(DTYPES)} and KV one of {', '.join(KV_DTYPES)}, "
                                 "e.g. float32/w4a8/float16")
            paths.append(parts)
    paths += [("float32", "w4a8", "float16", span) for span in spans]
    return list(dict.fromkeys(paths))


def path_logprobs(path: tuple, chunks: list[list[int]], ctx: int, model: str = DEFAULT_MODEL):
    """Yield, per window, the path's float32 log-probabilities of the scored positions ``[ctx/2, ctx-1)``.

    ``path`` is ``(dtype, quantization, KV cache dtype)``, and for ``w4a8`` optionally the
    activation span of ``CoarseActivations``.
    """
    from models import kv_cache
    from models.attention import SeqSpec, build_attention_metadata
    from models.loader import load_model

    dtype, quantization, kv_dtype, *span = path
    loaded = load_model(model, dtype=dtype, device="cpu", max_positions=ctx, quantization=quantization)
    if span:
        coarsen_activations(loaded.model, span[0])
    cfg = loaded.config
    blocks = kv_cache.cdiv(ctx, BLOCK_SIZE)
    caches = kv_cache.allocate_model(cfg, blocks, BLOCK_SIZE, getattr(torch, kv_dtype), torch.device("cpu"))
    meta = build_attention_metadata([SeqSpec(ctx, ctx, list(range(blocks)))], BLOCK_SIZE)
    scored = torch.arange(ctx // 2, ctx - 1)
    positions = torch.arange(ctx)
    for chunk in chunks:
        logits = loaded.model(torch.tensor(chunk), positions, meta, caches, scored)
        yield torch.log_softmax(logits.float(), dim=-1)


def measure(chunks: list[list[int]], ctx: int, paths: list[tuple[str, str, str]],
            model: str = DEFAULT_MODEL) -> list[Quality]:
    """Each path's figures; the first path is the reference the others are compared with."""
    targets = [torch.tensor(c[ctx // 2 + 1:]) for c in chunks]
    reference: list[torch.Tensor] = []
    results = []
    for path in paths:
        t0 = time.perf_counter()
        nll, kld, same = [], [], []
        for i, logp in enumerate(path_logprobs(path, chunks, ctx, model)):
            nll.append(-logp.gather(1, targets[i][:, None])[:, 0])
            if path == paths[0]:
                reference.append(logp)
                continue
            ref = reference[i]
            kld.append((ref.exp() * (ref - logp)).sum(-1).clamp(min=0))
            same.append((ref.argmax(-1) == logp.argmax(-1)).float())
        n = torch.cat(nll)
        name = path_name(path)
        if kld:
            k = torch.cat(kld).double()
            results.append(Quality(name, torch.exp(n.double().mean()).item(), k.mean().item(),
                                   torch.quantile(k, 0.99).item(), torch.cat(same).mean().item(), len(n),
                                   time.perf_counter() - t0))
        else:
            results.append(Quality(name, torch.exp(n.double().mean()).item(), None, None, None, len(n),
                                   time.perf_counter() - t0))
        print(f"  {name}: {results[-1].perplexity:.4f} ({results[-1].seconds:.0f} s)", file=sys.stderr, flush=True)
    return results


def _number(pattern: str, text: str) -> float:
    match = re.search(pattern, text)
    if match is None:
        raise RuntimeError(f"llama-perplexity printed no {pattern!r}; its output ends:\n{text[-2000:]}")
    return float(match.group(1))


def llama_cpp_quality(ctx: int, threads: int, gguf: Path, max_windows: int | None = None,
                      cache: Path = llama_cpp.DEFAULT_CACHE) -> list[Quality]:
    """llama.cpp's figures: its float32 run of the GGUF's weights, then the GGUF itself against it
    (the first ``max_windows`` windows only, where given: its ``--chunks``)."""
    bins = llama_cpp.ensure_built(cache)
    f32 = cache / f"{gguf.stem}-f32.gguf"
    if not f32.exists():
        subprocess.run([str(bins["llama-quantize"]), "--allow-requantize", str(gguf), str(f32), "F32"],
                       check=True, capture_output=True)
    common = ["-f", str(TEXT), "-c", str(ctx), "-b", str(ctx), "-t", str(threads)]
    if max_windows is not None:
        common += ["--chunks", str(max_windows)]
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base.kld"
        t0 = time.perf_counter()
        run = subprocess.run([str(bins["llama-perplexity"]), "-m", str(f32), *common, "--kl-divergence-base",
                              str(base)], check=True, capture_output=True, text=True)
        text = run.stdout + run.stderr
        tokens = int(_number(r"over (\d+) chunks", text)) * (ctx - 1 - ctx // 2)
        out.append(Quality("llama.cpp: float32 (the GGUF requantised to F32), f16 KV cache",
                           _number(r"Final estimate: PPL = ([0-9.]+)", text), None, None, None, tokens,
                           time.perf_counter() - t0))
        t0 = time.perf_counter()
        run = subprocess.run([str(bins["llama-perplexity"]), "-m", str(gguf), *common, "--kl-divergence-base",
                              str(base), "--kl-divergence"], check=True, capture_output=True, text=True)
        text = run.stdout + run.stderr
        out.append(Quality(f"llama.cpp: {gguf.name} as it is, f16 KV cache",
                           _number(r"Mean PPL\(Q\)\s*:\s*([0-9.]+)", text),
                           _number(r"Mean\s+KLD:\s*([0-9.]+)", text), _number(r"99\.0%\s+KLD:\s*([0-9.]+)", text),
                           _number(r"Same top p:\s*([0-9.]+)", text) / 100, tokens, time.perf_counter() - t0))
    return out


def table(rows: list[Quality], default: str | None) -> str:
    """The markdown table the README shows."""
    lines = ["| path | perplexity | mean KLD | p99 KLD | same top token |", "|---|---|---|---|---|"]
    for q in rows:
        name = q.name + (" (**default here**)" if q.name == default else "")
        if q.mean_kld is None:
            lines.append(f"| {name} | {q.perplexity:.4f} | (reference) | | |")
        else:
            lines.append(f"| {name} | {q.perplexity:.4f} | {q.mean_kld:.5f} | {q.p99_kld:.4f} | "
                         f"{100 * q.same_top:.2f}% |")
    return "\n".join(lines)


def default_path(model: str = DEFAULT_MODEL) -> tuple[str, str, str]:
    """The path ``kvserve serve --model MODEL`` picks here with no flags: (dtype, quantization, KV
    cache dtype), as the loader resolves ``auto`` (``models.autotune``'s cached or measured choice).

    NOTE: a choice of ``w4a8`` on AMX-INT8 tiles is scored on VNNI (a forced ``w4a8`` runs
    there): the two give equal results, bit for bit.
    """
    from models import autotune, kv_cache
    from models.loader import read_config

    config, gguf_type, types = read_config(model)
    path = autotune.choose(config, "auto", "auto", four_bit=autotune.four_bit(gguf_type), types=types)
    kv = str(kv_cache.default_dtype(getattr(torch, path.dtype))).removeprefix("torch.")
    return path.dtype, path.quantization, kv


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.quality", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, metavar="NAME|FILE",
                   help=f"the model to score, as kvserve serve --model takes it (default {DEFAULT_MODEL})")
    p.add_argument("--paths", nargs="+", default=["all"], metavar="all|default|DTYPE/QUANT/KV",
                   help="kvserve's paths to score besides the exact one (default: all)")
    p.add_argument("--max-windows", type=int, default=None, metavar="N",
                   help="score only the first N windows of the text, in both engines (default: every window)")
    p.add_argument("--ctx", type=int, default=512, help="window length (llama-perplexity's -c)")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp's threads (kvserve uses torch's)")
    p.add_argument("--no-llama-cpp", action="store_true", help="leave llama.cpp out")
    p.add_argument("--activation-spans", nargs="+", default=[], metavar="N|row",
                   help="also w4a8 with one activation scale per N inputs (or per row), emulated")
    return p


def model_file(p: argparse.ArgumentParser, name: str, llama: bool) -> Path:
    """``--model`` resolved as ``kvserve serve`` resolves it; a ``.gguf`` where llama.cpp runs on it."""
    from models.loader import resolve_model_path

    try:
        path = resolve_model_path(name)
    except ValueError as exc:  # not fetched yet (the message names the command), or no such file
        p.error(f"--model {name!r}: {exc}")
    if llama and path.suffix != ".gguf":
        p.error(f"--model {name!r}: llama.cpp runs a .gguf file, not {path}; add --no-llama-cpp")
    return path


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.max_windows is not None and args.max_windows < 1:
        p.error("--max-windows must be at least 1")
    spans = [0 if s == "row" else int(s) for s in args.activation_spans]
    path = model_file(p, args.model, not args.no_llama_cpp)
    default = default_path(args.model)
    try:
        paths = select_paths(args.paths, default, spans, amx_bf16=ops.amx_bf16_usable())
    except ValueError as exc:
        p.error(str(exc))
    from models.loader import read_tokenizer

    tokenizer = read_tokenizer(args.model)
    ids = tokenizer.encode(TEXT.read_text())
    chunks = windows(ids, args.ctx)[:args.max_windows]
    if tokenizer.add_bos_token:  # llama-perplexity puts BOS in each window's first slot
        chunks = [[tokenizer.bos_token_id, *c[1:]] for c in chunks]
    print(f"{path.name}: {len(ids)} tokens, {len(chunks)} windows of {args.ctx}", file=sys.stderr)
    rows = measure(chunks, args.ctx, paths, args.model)
    if not args.no_llama_cpp:
        rows += llama_cpp_quality(args.ctx, args.threads, path, args.max_windows)
    print(table(rows, path_name(default)))
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    tag = "" if args.model == DEFAULT_MODEL else f"-{path.stem}"
    out = REPO / "bench" / "results" / f"quality-{stamp}{tag}.json"
    command = shlex.join(["python", "-m", "bench.quality", *(sys.argv[1:] if argv is None else argv)])
    out.write_text(json.dumps({"date": stamp, "command": command, "model": path.name, "text": TEXT.name,
                               "text_tokens": len(ids), "ctx": args.ctx, "windows": len(chunks),
                               "default_path": path_name(default), "rows": [asdict(r) for r in rows]}, indent=1))
    print(f"wrote {out.relative_to(REPO)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

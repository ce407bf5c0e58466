"""What each run path costs in accuracy, measured against the float model, beside llama.cpp.

    python -m bench.quality                 # every path, then llama.cpp on the same file and text
    python -m bench.quality --no-llama-cpp  # kvserve's paths only
    python -m bench.quality --no-llama-cpp --activation-spans 16 32 row  # w4a8 with coarser scales

Teacher-forced over ``bench/data/quality_text.txt`` (an original text of
about 4,700 words that ships with the repo), the way ``llama-perplexity``
scores a file: the tokens in windows of ``--ctx`` (512), each window run
from an empty cache, and the second half of each window scored (every
position predicting the next token, so each has at least ctx/2 tokens of
context). For each of kvserve's paths: perplexity, and against the exact
path (float32 activations, dense weights, float32 KV cache: the GGUF's own
weights computed in float32) the mean and 99th percentile of the
per-token KL divergence KL(float || path) and how often the two agree on
the top token. Beside them, llama.cpp's ``llama-perplexity
--kl-divergence`` on the same GGUF and text (built by ``bench.llama_cpp``),
against its own float32 run of the same weights (``llama-quantize
--allow-requantize ... F32``): the same figures, each engine measured
against its own exact path. Prints a markdown table and writes the JSON to
``bench/results/quality-<time>.json``.

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
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench import llama_cpp
from models import ops
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


def path_logprobs(path: tuple, chunks: list[list[int]], ctx: int):
    """Yield, per window, the path's float32 log-probabilities of the scored positions ``[ctx/2, ctx-1)``.

    ``path`` is ``(dtype, quantization, KV cache dtype)``, and for ``w4a8`` optionally the
    activation span of ``CoarseActivations``.
    """
    from models import kv_cache
    from models.attention import SeqSpec, build_attention_metadata
    from models.loader import load_model

    dtype, quantization, kv_dtype, *span = path
    loaded = load_model("smollm2", dtype=dtype, device="cpu", max_positions=ctx, quantization=quantization)
    if span:
        coarsen_activations(loaded.model, span[0])
    cfg = loaded.config
    blocks = kv_cache.cdiv(ctx, BLOCK_SIZE)
    caches = kv_cache.allocate(cfg.num_hidden_layers, blocks, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim,
                               getattr(torch, kv_dtype), torch.device("cpu"))
    meta = build_attention_metadata([SeqSpec(ctx, ctx, list(range(blocks)))], BLOCK_SIZE)
    scored = torch.arange(ctx // 2, ctx - 1)
    positions = torch.arange(ctx)
    for chunk in chunks:
        logits = loaded.model(torch.tensor(chunk), positions, meta, caches, scored)
        yield torch.log_softmax(logits.float(), dim=-1)


def measure(chunks: list[list[int]], ctx: int, paths: list[tuple[str, str, str]]) -> list[Quality]:
    """Each path's figures; the first path is the reference the others are compared with."""
    targets = [torch.tensor(c[ctx // 2 + 1:]) for c in chunks]
    reference: list[torch.Tensor] = []
    results = []
    for path in paths:
        t0 = time.perf_counter()
        nll, kld, same = [], [], []
        for i, logp in enumerate(path_logprobs(path, chunks, ctx)):
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


def llama_cpp_quality(ctx: int, threads: int, cache: Path = llama_cpp.DEFAULT_CACHE) -> list[Quality]:
    """llama.cpp's figures: its float32 run of the GGUF's weights, then the GGUF itself against it."""
    bins = llama_cpp.ensure_built(cache)
    gguf = llama_cpp.find_gguf()
    f32 = cache / f"{gguf.stem}-f32.gguf"
    if not f32.exists():
        subprocess.run([str(bins["llama-quantize"]), "--allow-requantize", str(gguf), str(f32), "F32"],
                       check=True, capture_output=True)
    common = ["-f", str(TEXT), "-c", str(ctx), "-b", str(ctx), "-t", str(threads)]
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


def default_path() -> str:
    """The path ``kvserve serve`` picks here, named as ``measure`` names its rows."""
    from models import autotune, kv_cache
    from models.loader import read_config

    config, gguf_type, types = read_config("smollm2")
    path = autotune.choose(config, "auto", "auto", four_bit=autotune.four_bit(gguf_type), types=types)
    kv = str(kv_cache.default_dtype(getattr(torch, path.dtype))).removeprefix("torch.")
    return f"{path.dtype} + {path.quantization}, {kv} KV cache"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.quality", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ctx", type=int, default=512, help="window length (llama-perplexity's -c)")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp's threads (kvserve uses torch's)")
    p.add_argument("--no-llama-cpp", action="store_true", help="leave llama.cpp out")
    p.add_argument("--activation-spans", nargs="+", default=[], metavar="N|row",
                   help="also w4a8 with one activation scale per N inputs (or per row), emulated")
    args = p.parse_args(argv)
    spans = [0 if s == "row" else int(s) for s in args.activation_spans]
    from models.loader import load_model

    tokenizer = load_model("smollm2", dtype="float32", device="cpu", quantization="none").tokenizer
    ids = tokenizer.encode(TEXT.read_text())
    chunks = windows(ids, args.ctx)
    if tokenizer.add_bos_token:  # llama-perplexity puts BOS in each window's first slot
        chunks = [[tokenizer.bos_token_id, *c[1:]] for c in chunks]
    print(f"{len(ids)} tokens, {len(chunks)} windows of {args.ctx}", file=sys.stderr)
    # amx-bf16 and w4a16 only run where the CPU has AMX-BF16.
    amx_bf16 = [("float32", q, "float16") for q in ("amx-bf16", "w4a16")] if ops.amx_bf16_usable() else []
    rows = measure(chunks, args.ctx, PATHS + amx_bf16 + [("float32", "w4a8", "float16", span) for span in spans])
    if not args.no_llama_cpp:
        rows += llama_cpp_quality(args.ctx, args.threads)
    default = default_path()
    print(table(rows, default))
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = REPO / "bench" / "results" / f"quality-{stamp}.json"
    out.write_text(json.dumps({"date": stamp, "text": TEXT.name, "text_tokens": len(ids), "ctx": args.ctx,
                               "default_path": default, "rows": [asdict(r) for r in rows]}, indent=1))
    print(f"wrote {out.relative_to(REPO)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

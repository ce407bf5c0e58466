"""Forward-only speed of the model: load time, prefill and single-sequence decode.

    python -m bench.forward --dtype float32 --prompt-len 512 --decode-steps 64

Runs the model directly over a paged KV cache (no scheduler, no sampler), so
the numbers are the ceiling the engine can reach for one sequence.
"""

from __future__ import annotations

import argparse
import time

import torch

from models import kv_cache
from models.attention import SeqSpec, build_attention_metadata
from models.loader import load_model


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--decode-steps", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quantization", default="none", choices=["none", "int4", "w4a8"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16", "int8"],
                   help="auto: the model's dtype")
    args = p.parse_args(argv)

    t0 = time.perf_counter()
    loaded = load_model(args.model, dtype=args.dtype, device="cpu", quantization=args.quantization)
    load_s = time.perf_counter() - t0
    model, cfg = loaded.model, loaded.config
    block = 16
    total = args.prompt_len + args.decode_steps + 1
    nblocks = kv_cache.cdiv(total, block)
    kv_dtype = loaded.dtype if args.kv_cache_dtype == "auto" else getattr(torch, args.kv_cache_dtype)
    kv = kv_cache.allocate_model(cfg, nblocks, block, kv_dtype)
    table = list(range(nblocks))
    ids = torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=torch.Generator().manual_seed(0))
    t = args.prompt_len
    meta = build_attention_metadata([SeqSpec(t, t, table)], block)
    last = torch.tensor([t - 1])
    model(ids, torch.arange(t), meta, kv, last)  # warm-up
    t0 = time.perf_counter()
    for _ in range(args.repeats):
        model(ids, torch.arange(t), meta, kv, last)
    prefill = args.repeats * t / (time.perf_counter() - t0)

    token = ids[:1]
    t0 = time.perf_counter()
    for pos in range(t, t + args.decode_steps):
        meta = build_attention_metadata([SeqSpec(1, pos + 1, table)], block)
        logits = model(token, torch.tensor([pos]), meta, kv, torch.tensor([0]))
        token = logits.argmax(-1)
    decode = args.decode_steps / (time.perf_counter() - t0)
    print(f"model {args.model} dtype {args.dtype} quantization {args.quantization} "
          f"kv {str(kv_dtype).removeprefix('torch.')} threads {torch.get_num_threads()}: "
          f"load {load_s:.1f}s, prefill {prefill:.0f} tok/s ({t}-token prompt), "
          f"decode {decode:.1f} tok/s (batch 1, context {t}..{t + args.decode_steps})")


if __name__ == "__main__":
    main()

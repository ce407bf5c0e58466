"""Offline throughput: kvserve's LLMEngine.generate vs transformers' generate.

Both run the same prompts on the same weights (the default model's GGUF,
dequantised) in the same process, greedy, with a fixed number of output
tokens (EOS ignored), so tokens/s compare like for like. transformers uses
static batching: the prompts are left-padded into batches of ``--hf-batch``.

    python -m bench.offline --num-prompts 32 --input-len 128 --output-len 64
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch


def make_prompts(tokenizer, num: int, input_len: int, seed: int) -> list[list[int]]:
    """``num`` token-id prompts of exactly ``input_len`` tokens, each different."""
    rng = random.Random(seed)
    words = ("the quick brown fox jumps over a lazy dog while seven wizards quietly "
             "mix bright potions under old stone bridges near the river").split()
    prompts = []
    for i in range(num):
        text = f"[{i}-{rng.random():.6f}] " + " ".join(rng.choice(words) for _ in range(input_len * 2))
        prompts.append(tokenizer.encode(text, add_special_tokens=False)[:input_len])
    return prompts


def run_kvserve(args, prompts) -> dict:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, quantization=args.quantization,
                                    kv_cache_dtype=args.kv_cache_dtype,
                                    kv_cache_memory=args.kv_cache_memory * 2**20,
                                    max_num_seqs=args.max_num_seqs))
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    engine.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    results = engine.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    out_tokens = sum(len(r[0].token_ids) for r in results)
    return {"engine": "kvserve", "seconds": elapsed, "output_tokens": out_tokens,
            "output_tok_s": out_tokens / elapsed, "kv_cache_dtype": str(engine.runner.kv_dtype).removeprefix("torch.")}


def run_transformers(args, prompts) -> dict:
    from transformers import AutoModelForCausalLM

    from models.loader import resolve_model_path

    path = resolve_model_path(args.model)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32 if args.dtype != "bfloat16" else torch.bfloat16)
    model.eval()
    pad = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0
    out_tokens = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), args.hf_batch):
            batch = prompts[i:i + args.hf_batch]
            width = max(len(p) for p in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.output_len,
                                 min_new_tokens=args.output_len, do_sample=False, pad_token_id=pad)
            out_tokens += (out.shape[1] - width) * len(batch)
    elapsed = time.perf_counter() - t0
    return {"engine": f"transformers (static batch {args.hf_batch})", "seconds": elapsed,
            "output_tokens": out_tokens, "output_tok_s": out_tokens / elapsed}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default="auto", help="kvserve's path, as `kvserve serve --quantization`")
    p.add_argument("--kv-cache-dtype", default="auto", help="as `kvserve serve --kv-cache-dtype`")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--kv-cache-memory", type=int, default=512, help="MiB")
    p.add_argument("--hf-batch", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)

    from models.gguf_loader import open_gguf
    from models.loader import resolve_model_path
    from models.tokenizer import Tokenizer

    path = resolve_model_path(args.model)
    tok = Tokenizer.from_hf_dir(path) if path.is_dir() else Tokenizer.from_gguf_fields(open_gguf(path).fields)
    prompts = make_prompts(tok, args.num_prompts, args.input_len, args.seed)
    rows = [run_kvserve(args, prompts)]
    if not args.skip_transformers:
        rows.append(run_transformers(args, prompts))
    print(f"\n{args.num_prompts} prompts x {args.input_len} input tokens -> {args.output_len} output tokens, "
          f"greedy, torch threads {torch.get_num_threads()}")
    print("| engine | seconds | output tokens | output tok/s |\n|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['engine']} | {r['seconds']:.1f} | {r['output_tokens']} | {r['output_tok_s']:.1f} |")
    if len(rows) == 2:
        print(f"\nkvserve / transformers: {rows[0]['output_tok_s'] / rows[1]['output_tok_s']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()

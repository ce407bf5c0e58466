"""How many sequences of a length a KV cache budget holds, with and without the hybrid layout.

    python -m bench.kv_capacity --model gemma-3-270m                   # 512 MiB, 8k tokens
    python -m bench.kv_capacity --model gemma-3-270m --tokens 32768 --kv-cache-memory 2048

Builds the engine as ``kvserve serve`` would with ``--kv-cache-memory``,
``--max-model-len TOKENS`` and ``--dtype/--quantization`` (float32, none by
default: the layout does not depend on the weights' path), once with the
hybrid KV cache (sliding-window layers give back the blocks their window has
left) and once with ``--disable-hybrid-kv-cache-manager``, and prints a
markdown table: the layout, the block ids the budget buys, the most one
sequence of TOKENS holds (its full groups' blocks, its windowed groups' window
plus a step's chunk), and how many such sequences fit at once. The figures are
the engine's own sizing (``LLMEngine.kv_layout``, ``num_blocks``), the numbers
it admits and preempts by (``tests/engine/test_scheduler.py`` checks that a
windowed group's sequences really run together in that room).
"""

from __future__ import annotations

import argparse
import gc

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_runner import kv_bytes_per_block
from models.kv_cache import cdiv

MiB = 1 << 20


def capacity(model: str, tokens: int, budget_mib: int, hybrid: bool, dtype: str, quantization: str) -> dict:
    """The engine's layout and sizing for one setting."""
    engine = LLMEngine(EngineConfig(model=model, dtype=dtype, quantization=quantization, device="cpu",
                                    kv_cache_memory=budget_mib * MiB, max_model_len=tokens, hybrid_kv_cache=hybrid))
    try:
        lay = engine.kv_layout
        per_seq = lay.blocks_for(tokens, engine.block_size, engine.budget.max_num_batched_tokens)
        return dict(hybrid=hybrid, groups=lay.num_groups, layers_per_block=lay.num_slots,
                    windows=",".join(str(w) for w in lay.group_windows), num_blocks=engine.num_blocks,
                    blocks_per_seq=per_seq, seqs=engine.num_blocks // per_seq,
                    kv_mib_per_seq=per_seq * kv_bytes_per_block(engine.model_config, engine.runner.kv_dtype,
                                                                 engine.block_size, layout=lay) / MiB)
    finally:
        engine.shutdown()
        del engine
        gc.collect()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--tokens", type=int, default=8192, help="each sequence's length (and --max-model-len)")
    p.add_argument("--kv-cache-memory", type=int, default=512, help="the budget in MiB")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantization", default="none")
    args = p.parse_args(argv)
    rows = [capacity(args.model, args.tokens, args.kv_cache_memory, hybrid, args.dtype, args.quantization)
            for hybrid in (True, False)]
    print(f"{args.model}: sequences of {args.tokens} tokens in a {args.kv_cache_memory} MiB KV cache "
          f"(blocks of 16 tokens)\n")
    print("| KV layout | groups x layers a block | windows | block ids | block ids a sequence | MiB a sequence "
          "| sequences that fit |")
    print("|---|---|---|---:|---:|---:|---:|")
    for r in rows:
        name = "hybrid (default)" if r["hybrid"] else "every block kept (`--disable-hybrid-kv-cache-manager`)"
        print(f"| {name} | {r['groups']} x {r['layers_per_block']} | {r['windows']} | {r['num_blocks']} "
              f"| {r['blocks_per_seq']} | {r['kv_mib_per_seq']:.1f} | {r['seqs']} |")
    flat, hybrid = rows[1]["seqs"], rows[0]["seqs"]
    print(f"\n{hybrid / max(flat, 1):.2f}x the sequences with the hybrid layout "
          f"(full attention everywhere would need {cdiv(args.tokens, 16)} blocks of every layer a sequence)")


if __name__ == "__main__":
    main()

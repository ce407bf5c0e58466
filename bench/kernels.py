"""Speed of kvserve's CPU kernels alone, on the default model's shapes.

    python -m bench.kernels --rows 1 16 64 512

* The grouped GEMM on SmolLM2-135M's four projection shapes (qkv 960x576,
  o 576x576, gate_up 3072x576, down 576x1536), summed: 4-bit weights with
  float32 activations (``int4``) and with int8 activations (``w4a8``), and
  MKL's float32 GEMM on column-major weights for reference.
* Paged decode attention over 30 layers' float16 and int8 caches (a 512 MiB budget's
  worth of blocks, each sequence's blocks spread over it), 9 query and 3 KV
  heads of 64, at context 200.

Each figure is the best of several runs (this machine is shared and noisy).
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

import torch

from models import kv_cache, ops
from models.quant import pack_int4

PROJECTIONS = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def best_ms(f: Callable[[], object], runs: int) -> float:
    """The fastest of ``runs`` calls of ``f`` after one warm-up, in milliseconds."""
    f()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def gemm_table(rows: list[int], runs: int) -> None:
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) for n, k in PROJECTIONS]
    packed = [pack_int4(w) for w in weights]
    column_major = [w.t().contiguous().t() for w in weights]
    # Where the CPU offers AMX-INT8, w4a8 on its tiles too (grouped_gemm.cpp runs them from
    # kAmxMinRows rows; below that the column repeats VNNI's kernel).
    amx = ops.amx_usable()
    print("| rows | int4 (float acts) | w4a8 (int8 acts) |" + (" w4a8 on AMX |" if amx else "")
          + " MKL float32 | w4a8 GOP/s |")
    print("|---:|---:|---:|" + ("---:|" if amx else "") + "---:|---:|")
    for m in rows:
        xs = [torch.randn(m, k, generator=gen) for _, k in PROJECTIONS]

        def run(f: Callable[[torch.Tensor, int], object]) -> float:
            return sum(best_ms(lambda: f(x, i), runs) for i, x in enumerate(xs))

        def w4a8(x: torch.Tensor, i: int) -> torch.Tensor:
            return ops.grouped_linear(x, *packed[i], PROJECTIONS[i][0], int8_activations=True)

        t_int4 = run(lambda x, i: ops.grouped_linear(x, *packed[i], PROJECTIONS[i][0]))
        t_w4a8 = run(w4a8)
        amx_cell = ""
        if amx:
            ops.set_amx_enabled(True)
            try:
                t_amx = run(w4a8)
            finally:
                ops.set_amx_enabled(False)
            amx_cell = f" {t_amx * 1e3:.0f} us |"
        t_mkl = run(lambda x, i: torch.nn.functional.linear(x, column_major[i]))
        gop = 2 * m * sum(n * k for n, k in PROJECTIONS) / (t_w4a8 * 1e-3) / 1e9
        print(f"| {m} | {t_int4 * 1e3:.0f} us | {t_w4a8 * 1e3:.0f} us |{amx_cell} {t_mkl * 1e3:.0f} us | {gop:.0f} |")


def attention_table(batches: list[int], runs: int, context: int = 200, layers: int = 30,
                    blocks: int = 1456) -> None:
    block_size, kv_heads, heads, head_dim = 16, 3, 9, 64
    gen = torch.Generator().manual_seed(0)
    values = [[torch.randn(blocks, block_size, kv_heads, head_dim, generator=gen) for _ in range(2)]
              for _ in range(layers)]
    dtypes = (torch.float16, torch.int8)
    caches = {dt: [tuple(kv_cache.to_cache_rows(x, dt) for x in kv) for kv in values] for dt in dtypes}
    del values
    print(f"| sequences | attention, {layers} layers, float16 cache | int8 cache |")
    print("|---:|---:|---:|")
    for b in batches:
        order = list(range(blocks))
        random.Random(b).shuffle(order)
        per_seq = kv_cache.cdiv(context, block_size)
        tables = torch.tensor([order[i * per_seq:(i + 1) * per_seq] for i in range(b)])
        lens = torch.full((b,), context)
        q = torch.randn(b, heads, head_dim, generator=gen)

        def step(layer_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
            for k, v in layer_caches:
                ops.decode_attention(q, k, v, tables, lens, context, head_dim ** -0.5)

        times = [best_ms(lambda: step(caches[dt]), runs) for dt in dtypes]
        print(f"| {b} | " + " | ".join(f"{t:.1f} ms" for t in times) + " |")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 512])
    p.add_argument("--sequences", type=int, nargs="+", default=[16, 64])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    if not ops.kernels_available():
        raise SystemExit("kvserve's CPU kernels are not available here (see `python -m models.ops`)")
    if not ops.has_int8_dots():
        raise SystemExit("the w4a8 kernels need AVX2 or AVX-512")
    torch.set_num_threads(args.threads)
    print(f"{torch.get_num_threads()} threads\n")
    gemm_table(args.rows, args.runs)
    print()
    attention_table(args.sequences, args.runs)


if __name__ == "__main__":
    main()

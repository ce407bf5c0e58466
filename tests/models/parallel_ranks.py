"""One rank of a tensor-parallel forward, for ``test_parallel.py`` (run as a script).

``python parallel_ranks.py RANK WORLD PORT MODEL QUANTIZATION OUT [ADAPTER]``: joins a
gloo group on 127.0.0.1:PORT, loads this rank's slice of MODEL in float32 (and of the
LoRA ADAPTER, which every step then runs), runs a 21-token prompt and then two decodes
over a paged cache of its own KV heads, and (rank 0) saves the logits of every step to
OUT. WORLD 1 is the whole model.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from models import kv_cache  # noqa: E402
from models.attention import SeqSpec, build_attention_metadata  # noqa: E402
from models.loader import load_model  # noqa: E402
from models.lora import LoRABatch, load_adapter  # noqa: E402
from models.parallel import TensorParallel  # noqa: E402

PROMPT = [(7 * i + 3) % 120 for i in range(21)]


def main() -> None:
    rank, world, port, model, quantization, out, *adapter_dir = sys.argv[1:]
    rank, world = int(rank), int(world)
    torch.set_num_threads(1)
    tp = None
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        tp = TensorParallel(rank, world)
    loaded = load_model(model, "float32", "cpu", quantization=quantization, tp=tp)
    cfg = loaded.config
    adapter = (load_adapter("a", adapter_dir[0], cfg, torch.float32, torch.device("cpu"), tp=tp)
               if adapter_dir else None)
    caches = kv_cache.allocate_model(cfg, 8, 16, torch.float32, torch.device("cpu"), tp_size=world)
    blocks = [3, 5]
    steps = [(PROMPT, 0), ([11], len(PROMPT)), ([42], len(PROMPT) + 1)]
    logits = []
    for tokens, start in steps:
        end = start + len(tokens)
        meta = build_attention_metadata([SeqSpec(len(tokens), end, blocks)], 16)
        lora = LoRABatch.of_spans([(adapter, 0, len(tokens))])
        logits.append(loaded.model(torch.tensor(tokens), torch.arange(start, end), meta, caches, lora=lora))
    if rank == 0:
        torch.save(torch.cat(logits), out)
    if world > 1:
        dist.destroy_process_group()
    # NOTE: no interpreter teardown: gloo's threads destroyed there can abort the
    # process after its work is done (engine.workers.exit_now).
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

"""Where a decode step's time goes: a whole step of the model against its parts, each timed alone.

    python -m bench.step --sequences 1 16 64 --context 200

Runs ``LlamaForCausalLM.forward`` for one decode token per sequence over a
paged cache (float16 unless ``--kv-cache-dtype``; blocks spread over a 512 MiB
float16 budget's worth, as in the server), then times on the same shapes: the four projections of every layer
with that layer's weights (``grouped_linear``), paged attention over every layer's cache, and the LM
head. "The rest" is the step minus those parts: norms, RoPE, the per-layer
calls, Python. Each figure is the best of several runs.
"""

from __future__ import annotations

import argparse
import random

import torch

from bench.kernels import best_ms
from models import kv_cache, ops
from models.attention import SeqSpec, build_attention_metadata
from models.loader import load_model
from models.gguf_linear import NativeLinear
from models.quant import AmxBf16Linear, QuantizedLinear


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--quantization", default="auto", choices=["auto", "int4", "w4a8", "amx-bf16", "w4a16"])
    p.add_argument("--sequences", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--kv-cache-dtype", default="float16", choices=["float32", "float16", "bfloat16", "int8"])
    p.add_argument("--blocks", type=int, default=1456, help="cache blocks per layer (1456: 512 MiB, float16)")
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args(argv)

    loaded = load_model(args.model, dtype="float32", device="cpu", quantization=args.quantization)
    model, cfg = loaded.model, loaded.config
    layer = model.model.layers[0]
    if not hasattr(layer.mlp, "gate_up_proj"):
        raise SystemExit(f"{args.model}: a mixture of experts; bench.step times a dense layer's parts "
                         "(serve it beside llama-server with python -m bench.peers --no-vllm --model FILE)")
    projections = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    if not all(isinstance(m, (QuantizedLinear, AmxBf16Linear, NativeLinear)) and m.fused
               for m in projections + [model.lm_head]):
        raise SystemExit("the step's parts are timed for kvserve's own kernels (int4, w4a8, amx-bf16 or w4a16)")
    block = 16
    shape = (args.blocks, block, cfg.num_key_value_heads, cfg.head_dim)
    kv_dtype = getattr(torch, args.kv_cache_dtype)
    kv = [tuple(kv_cache.to_cache_rows(torch.randn(shape), kv_dtype) for _ in range(2))
          for _ in range(cfg.num_hidden_layers)]
    scale = cfg.head_dim ** -0.5
    print("| sequences | step | projection GEMMs | paged attention | LM head | the rest |")
    print("|---:|---:|---:|---:|---:|---:|")
    for b in args.sequences:
        order = list(range(args.blocks))
        random.Random(b).shuffle(order)
        per_seq = kv_cache.cdiv(args.context + 1, block)
        if b * per_seq > args.blocks:
            raise SystemExit(f"{b} sequences of {args.context} tokens need more than {args.blocks} blocks")
        tables = [order[i * per_seq:(i + 1) * per_seq] for i in range(b)]
        meta = build_attention_metadata([SeqSpec(1, args.context + 1, t) for t in tables], block)
        ids, positions = torch.full((b,), 42), torch.full((b,), args.context)
        step = best_ms(lambda: model(ids, positions, meta, kv), args.runs)

        # Every layer's own weights, as the step reads them (one layer's would stay in cache).
        xs = [torch.randn(b, m.in_features) for m in projections]
        layers = [[lay.self_attn.qkv_proj, lay.self_attn.o_proj, lay.mlp.gate_up_proj, lay.mlp.down_proj]
                  for lay in model.model.layers]
        gemms = best_ms(lambda: [_project(x, m) for ms in layers for x, m in zip(xs, ms)], args.runs)
        q = torch.randn(b, cfg.num_attention_heads, cfg.head_dim)
        attention = best_ms(lambda: [ops.decode_attention(q, k, v, meta.block_tables, meta.context_lens,
                                                          args.context + 1, scale) for k, v in kv], args.runs)
        h = torch.randn(b, cfg.hidden_size)
        head = model.lm_head
        head_ms = best_ms(lambda: _project(h, head), args.runs)
        rest = step - gemms - attention - head_ms
        print(f"| {b} | {step:.1f} ms | {gemms:.1f} ms | {attention:.1f} ms | {head_ms:.1f} ms | {rest:.1f} ms |")


def _project(x: torch.Tensor, m: QuantizedLinear | AmxBf16Linear | NativeLinear) -> torch.Tensor:
    """``m``'s GEMM alone, by the kernel the fused layer calls for it."""
    if isinstance(m, (AmxBf16Linear, NativeLinear)):
        return m(x)  # its kind's AMX-BF16 kernel
    return ops.grouped_linear(x, m.codes, m.group_scales, m.out_features, m.int8_activations)


if __name__ == "__main__":
    main()

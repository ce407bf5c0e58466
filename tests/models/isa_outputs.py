"""Every vector kernel's outputs on fixed random data, and a model's greedy logprobs.

``test_cpu_isa.py`` runs this module in a process whose kernels are built for
AVX2 (``KVSERVE_CPU_ISA=avx2``) and compares what it writes with what the
AVX-512 build computes in the test's own process: the two must be equal, bit
for bit. ``python -m tests.models.isa_outputs OUT.pt [--model]`` writes them.
"""

from __future__ import annotations

import sys

import torch

from models import kv_cache, ops, quant
from models.dense import pack_dense

CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int8)


def _gemms(gen: torch.Generator) -> dict[str, torch.Tensor]:
    out = {}
    for n, k in ((45, 96), (96, 576)):
        w = torch.randn(n, k, generator=gen)
        for name, packed in (("int4", quant.pack_int4(w)), ("int8", quant.pack_int8(w))):
            for rows in (1, 7, 37):
                x = torch.randn(rows, k, generator=gen) * 3
                for a8 in (False, True):
                    out[f"grouped {name} a8={a8} {rows}x{k}x{n}"] = ops.grouped_linear(x, *packed, n, a8)
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(9, k, generator=gen).to(dtype)
            out[f"dense {dtype} 9x{k}x{n}"] = ops.dense_linear(x, pack_dense(w.to(dtype)), n)
    # a GGUF file's codes on the int8-activation GEMMs, each K-quant format and each table of
    # 4-bit indices (csrc/gguf_a8.cpp)
    from gguf import GGMLQuantizationType

    from models.gguf_native import a8_projection
    from models.gguf_quants import random_blocks
    from models.gguf_reader import GGUFTensor
    for i, type_name in enumerate(("Q4_K", "Q5_K", "Q6_K", "Q3_K", "MXFP4", "IQ4_XS", "Q4_0", "Q8_0", "Q4_1",
                                   "Q5_1", "Q5_0", "IQ4_NL")):
        raw = random_blocks(type_name, (48, 512), i, one_scale=True)
        linear = a8_projection(None, [GGUFTensor("t", int(GGMLQuantizationType[type_name]), (512, 48), raw)], [None])
        for rows in (1, 7, 37):
            out[f"gguf a8 {type_name} {rows}x512x48"] = linear(torch.randn(rows, 512, generator=gen) * 3)
        # the same codes as two experts' weights in one call (csrc/gguf_experts.cpp)
        experts = ops.a8_experts(linear.fused_args[:-1] * 2, linear.formats, 2, 512, 48)
        x = torch.randn(19, 512, generator=gen) * 3
        out[f"gguf a8 experts {type_name} 19x512x48"] = ops.gguf_a8_experts(x, experts, [0, 1], [2, 17], 48)
    return out


def _attention(gen: torch.Generator) -> dict[str, torch.Tensor]:
    out = {}
    block_size, blocks, kv_heads, heads = 16, 12, 2, 6
    for head_dim in (64, 128, 40):
        for cache_dtype in CACHE_DTYPES:
            shape = (blocks * block_size, kv_heads, head_dim)
            caches = []
            for _ in range(2):
                rows = kv_cache.to_cache_rows(torch.randn(shape, generator=gen), cache_dtype)
                caches.append(rows.view(blocks, block_size, kv_heads, -1).contiguous())
            tables = torch.randperm(blocks, generator=gen).view(2, blocks // 2)
            lens = torch.tensor([37, 96])
            q = torch.randn(2, heads, head_dim, generator=gen)
            key = f"hd={head_dim} cache={cache_dtype}"
            out[f"decode {key}"] = ops.decode_attention(q, *caches, tables, lens, 96, head_dim ** -0.5)
            qp = torch.randn(5 + 19, heads, head_dim, generator=gen)
            out[f"prefill {key}"] = ops.prefill_attention(qp, None, None, *caches, tables, [5, 19], [37, 96],
                                                          head_dim ** -0.5)
            # a sliding window of 21 positions: it starts inside a block
            out[f"decode window {key}"] = ops.decode_attention(q, *caches, tables, lens, 96, head_dim ** -0.5, 21)
            out[f"prefill window {key}"] = ops.prefill_attention(qp, None, None, *caches, tables, [5, 19], [37, 96],
                                                                 head_dim ** -0.5, 21)
            # Gemma 2's soft-capped scores (a cap the scores of these random rows reach)
            out[f"decode softcap {key}"] = ops.decode_attention(q, *caches, tables, lens, 96, head_dim ** -0.5, 0, 2.0)
            out[f"prefill softcap {key}"] = ops.prefill_attention(qp, None, None, *caches, tables, [5, 19], [37, 96],
                                                                  head_dim ** -0.5, 0, 2.0)
            # gpt-oss's sinks, a logit per head
            sinks = torch.randn(heads, generator=gen)
            out[f"decode sinks {key}"] = ops.decode_attention(q, *caches, tables, lens, 96, head_dim ** -0.5, 0, 0.0,
                                                              sinks)
            out[f"prefill sinks {key}"] = ops.prefill_attention(qp, None, None, *caches, tables, [5, 19], [37, 96],
                                                                head_dim ** -0.5, 0, 0.0, sinks)
    return out


def _rowwise(gen: torch.Generator) -> dict[str, torch.Tensor]:
    x, w = torch.randn(5, 576, generator=gen), torch.randn(576, generator=gen)
    normed, residual = ops.add_rms_norm(x, x.clone() * 0.5, w, 1e-5)
    logits = torch.randn(3, 49152, generator=gen)
    return {"rms_norm": ops.rms_norm(x, w, 1e-5), "add_rms_norm": normed, "residual": residual,
            "silu_and_mul": ops.silu_and_mul(torch.randn(5, 2 * 1536, generator=gen)),
            "argmax": ops.argmax(logits)}


def kernel_outputs() -> dict[str, torch.Tensor]:
    """Each kernel on seeded random inputs (odd sizes included: tails of tiles, groups and blocks)."""
    gen = torch.Generator().manual_seed(0)
    return {**_gemms(gen), **_attention(gen), **_rowwise(gen)}


# (dtype, quantization, KV cache dtype) of the model runs: each path the kernels serve.
MODEL_PATHS = (("float32", "w4a8", "float16"), ("float32", "int4", "int8"), ("float32", "none", "float32"),
               ("bfloat16", "w4a8", "bfloat16"))


def model_outputs() -> dict[str, torch.Tensor]:
    """SmolLM2's greedy tokens and top-5 logprobs on two prompts, one batched step, per path."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5)
    prompts = ["The capital of France is", "def fibonacci(n):\n    " + "# compute it\n    " * 12]
    out = {}
    for dtype, quantization, cache in MODEL_PATHS:
        engine = LLMEngine(EngineConfig(model="smollm2", dtype=dtype, quantization=quantization,
                                        kv_cache_dtype=cache, max_model_len=512, kv_cache_memory=32 << 20))
        for i, prompt in enumerate(prompts):
            engine.add_request(f"isa-{i}", engine.tokenizer.encode(prompt), params)
        while engine.has_unfinished_requests():
            for delta in engine.step():
                for lp in delta.outputs[0].logprobs or []:
                    key = f"{dtype} {quantization} {cache} {delta.request_id}"
                    out.setdefault(key, []).append([lp.token_id, lp.logprob] + [v for t in lp.top for v in t])
        del engine
    return {k: torch.tensor(v, dtype=torch.float64) for k, v in out.items()}

if __name__ == "__main__":
    torch.set_num_threads(2)
    results = kernel_outputs()
    if "--model" in sys.argv[2:]:
        results.update(model_outputs())
    results["isa"] = torch.tensor(list(f"{ops.vector_isa()} {ops.int8_dots()}".encode()))
    torch.save(results, sys.argv[1])

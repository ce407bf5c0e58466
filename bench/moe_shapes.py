"""Mixture-of-experts GGUF files at real shapes with random weights, for the speed benchmark.

    python -m bench.moe_shapes olmoe                 # OLMoE-1B-7B's shape: 16 layers, 64 experts, top-8
    python -m bench.moe_shapes qwen3moe --layers 8   # Qwen3-30B-A3B's shape cut to 8 of its 48 layers
    python -m bench.moe_shapes gptoss --layers 8     # gpt-oss-20b's shape, 8 of its 24 layers

Writes the shape as a GGUF at F16 (random normal weights, std 0.02; norms 1), tensor by
tensor so no whole model is held in memory, with the default model's tokenizer (SmolLM2's
49,152 tokens: the vocabulary is the one part not to scale), then turns it into Q4_K_M with
llama.cpp's ``llama-quantize`` (built by ``bench.llama_cpp``) and deletes the F16 file.
gpt-oss's shape is written at the types of its published GGUF instead, as random blocks (no
F16 file, no llama-quantize): MXFP4 experts, Q8_0 attention, embedding and head, float32
norms, biases, sinks and router; its attention alternates a 128-token window with the whole
context, YaRN over 4,096 positions. Prints the file's path, to serve with ``python -m bench.peers --no-vllm --model
PATH`` (kvserve and llama-server on the same file). The files go to the bench cache
(``~/.cache/kvserve-bench/moe``), never into the repository.
"""

from __future__ import annotations

import argparse
import subprocess
import time
from dataclasses import dataclass, replace
from pathlib import Path

import gguf
import numpy as np

from bench import llama_cpp


@dataclass(frozen=True)
class Shape:
    """An MoE decoder's sizes, as its config.json gives them."""

    arch: str  # llama.cpp's general.architecture
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    experts_used: int
    expert_ffn: int
    qk_norm: str  # "head": per-head norms (Qwen3); "proj": over the whole projection (OLMoE)
    rope_theta: float
    context: int


SHAPES = {
    "olmoe": Shape("olmoe", 16, 2048, 16, 16, 128, 64, 8, 1024, "proj", 10000.0, 4096),
    "qwen3moe": Shape("qwen3moe", 48, 2048, 32, 4, 128, 128, 8, 768, "head", 1000000.0, 40960),
}


def tensors(s: Shape, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor's name and numpy shape (rows last, as the file stores them)."""
    out = [("token_embd.weight", (vocab, s.hidden)), ("output_norm.weight", (s.hidden,)),
           ("output.weight", (vocab, s.hidden))]
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    norm = (q, kv) if s.qk_norm == "proj" else (s.head_dim, s.head_dim)
    for i in range(s.layers):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (s.hidden,)), (b + "attn_q.weight", (q, s.hidden)),
                (b + "attn_k.weight", (kv, s.hidden)), (b + "attn_v.weight", (kv, s.hidden)),
                (b + "attn_output.weight", (s.hidden, q)), (b + "attn_q_norm.weight", (norm[0],)),
                (b + "attn_k_norm.weight", (norm[1],)), (b + "ffn_norm.weight", (s.hidden,)),
                (b + "ffn_gate_inp.weight", (s.experts, s.hidden)),
                (b + "ffn_gate_exps.weight", (s.experts, s.expert_ffn, s.hidden)),
                (b + "ffn_up_exps.weight", (s.experts, s.expert_ffn, s.hidden)),
                (b + "ffn_down_exps.weight", (s.experts, s.hidden, s.expert_ffn))]
    return out


def _writer(path: Path, s: Shape, tokenizer_fields: dict, eps: float) -> gguf.GGUFWriter:
    """A GGUF writer with the shape's fields and the tokenizer's."""
    from tests.models.gguf_files import _add_field  # the tokenizer fields' writer the tests use

    w = gguf.GGUFWriter(str(path), s.arch)
    w.add_block_count(s.layers)
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.expert_ffn)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_layer_norm_rms_eps(eps)
    w.add_rope_freq_base(s.rope_theta)
    w.add_expert_count(s.experts)
    w.add_expert_used_count(s.experts_used)
    w.add_expert_feed_forward_length(s.expert_ffn)
    for key, value in tokenizer_fields.items():
        _add_field(w, key, value)
    return w


def write_f16(path: Path, s: Shape, tokenizer_fields: dict) -> None:
    """The F16 file, one tensor generated and written at a time."""
    vocab = len(tokenizer_fields["tokenizer.ggml.tokens"])
    w = _writer(path, s, tokenizer_fields, 1e-6)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    specs = tensors(s, vocab)
    for name, shape in specs:
        dtype = np.float32 if len(shape) == 1 else np.float16
        w.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for name, shape in specs:
        if len(shape) == 1:
            w.write_tensor_data(np.ones(shape, dtype=np.float32))
            continue
        data = np.empty(shape, dtype=np.float16)
        for j in range(shape[0]):  # an expert (or a row block) at a time: bounded memory
            data[j] = (rng.standard_normal(shape[1:], dtype=np.float32) * 0.02).astype(np.float16)
        w.write_tensor_data(data)
    w.close()


# gpt-oss-20b's config.json: 24 layers, hidden 2880, 64 query heads and 8 KV heads of 64,
# 32 experts of 2880 features, 4 a token, a 128-token window on every other layer.
GPTOSS = Shape("gpt-oss", 24, 2880, 64, 8, 64, 32, 4, 2880, "", 150000.0, 131072)


def write_gptoss(path: Path, s: Shape, tokenizer_fields: dict) -> None:
    """gpt-oss's shape at its file's types, random blocks: MXFP4 experts (an E8M0 scale near
    2^-7 and random E2M1 codes a block), Q8_0 projections (float16 scales near 3e-4, random
    int8 codes), float32 biases, sinks, norms (1) and router (std 0.02)."""
    t = gguf.GGMLQuantizationType
    vocab = len(tokenizer_fields["tokenizer.ggml.tokens"])
    w = _writer(path, s, tokenizer_fields, 1e-5)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(32.0)
    w.add_rope_scaling_orig_ctx_len(4096)
    w.add_sliding_window(128)
    q, kv, h, f, e = s.heads * s.head_dim, s.kv_heads * s.head_dim, s.hidden, s.expert_ffn, s.experts
    specs = [("token_embd.weight", (vocab, h), t.Q8_0), ("output_norm.weight", (h,), None),
             ("output.weight", (vocab, h), t.Q8_0)]
    for i in range(s.layers):
        b = f"blk.{i}."
        specs += [(b + "attn_norm.weight", (h,), None), (b + "post_attention_norm.weight", (h,), None),
                  (b + "attn_sinks.weight", (s.heads,), None)]
        for name, rows, cols in (("attn_q", q, h), ("attn_k", kv, h), ("attn_v", kv, h), ("attn_output", h, q)):
            specs += [(b + name + ".weight", (rows, cols), t.Q8_0), (b + name + ".bias", (rows,), None)]
        specs += [(b + "ffn_gate_inp.weight", (e, h), None), (b + "ffn_gate_inp.bias", (e,), None)]
        for name, rows, cols in (("ffn_gate_exps", f, h), ("ffn_up_exps", f, h), ("ffn_down_exps", h, f)):
            specs += [(b + name + ".weight", (e, rows, cols), t.MXFP4), (b + name + ".bias", (e, rows), None)]
    for name, shape, qtype in specs:
        if qtype is None:
            w.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
        else:
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            byte_shape = (*shape[:-1], shape[-1] // block * size)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for name, shape, qtype in specs:
        if qtype is None:
            ones = name.endswith("norm.weight")
            w.write_tensor_data(np.ones(shape, np.float32) if ones
                                else (rng.standard_normal(shape, dtype=np.float32) * 0.02))
            continue
        blocks = int(np.prod(shape)) // 32
        if qtype == t.MXFP4:
            data = rng.integers(0, 256, (blocks, 17), dtype=np.uint8)
            data[:, 0] = rng.integers(118, 122, blocks)  # (2^(e - 127): about 2^-7)
        else:
            data = rng.integers(-127, 128, (blocks, 34), dtype=np.int16).astype(np.uint8)
            data[:, :2] = (rng.uniform(2e-4, 4e-4, blocks).astype(np.float16).view(np.uint8).reshape(blocks, 2))
        w.write_tensor_data(data.reshape(*shape[:-1], -1))
    w.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shape", choices=sorted([*SHAPES, "gptoss"]))
    p.add_argument("--layers", type=int, default=None, help="cut the shape to this many layers")
    p.add_argument("--out", type=Path, default=llama_cpp.DEFAULT_CACHE / "moe")
    args = p.parse_args(argv)
    from models.gguf_reader import read_gguf
    from models.loader import resolve_model_path

    base = GPTOSS if args.shape == "gptoss" else SHAPES[args.shape]
    shape = base if args.layers is None else replace(base, layers=args.layers)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"{args.shape}-{shape.layers}l-random"
    f16, q4 = args.out / f"{stem}-f16.gguf", args.out / f"{stem}-q4_k_m.gguf"
    fields = {k: v for k, v in read_gguf(resolve_model_path("smollm2")).fields.items() if k.startswith("tokenizer.")}
    start = time.monotonic()
    if args.shape == "gptoss":
        path = args.out / f"{stem}-mxfp4.gguf"
        write_gptoss(path, shape, fields)
        print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB) in {time.monotonic() - start:.0f} s")
        print(path)
        return
    write_f16(f16, shape, fields)
    print(f"wrote {f16} ({f16.stat().st_size / 1e9:.2f} GB) in {time.monotonic() - start:.0f} s", flush=True)
    quantize = llama_cpp.ensure_built()["llama-quantize"]
    start = time.monotonic()
    subprocess.run([str(quantize), str(f16), str(q4), "Q4_K_M"], check=True, stdout=subprocess.DEVNULL)
    f16.unlink()
    print(f"wrote {q4} ({q4.stat().st_size / 1e9:.2f} GB) in {time.monotonic() - start:.0f} s")
    print(q4)


if __name__ == "__main__":
    main()

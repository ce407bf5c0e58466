"""Tiny GGUF files whose tensors are of many quantisation types, with their transformers twins.

``write_mixed_gguf`` writes a random Qwen2 (biases, 2 KV heads of 128 dimensions, as
Qwen2.5's) or Llama whose projections, embedding and head are random blocks of the
given GGUF types (the K-quants and IQ4 types cannot be quantised by the ``gguf``
package, so the blocks come first), and returns the transformers model holding the
same weights dequantised: the reference for every path that loads the file.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from models.gguf_loader import permute_back
from models.gguf_quants import random_blocks, split

# Shapes of a Qwen2.5 layer, small: head size 128, 2 KV heads, K-quant rows (256 inputs).
MIXED_CONFIG = dict(hidden_size=512, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6)

# Per layer, each projection's type; the head's and the embedding's (a Q4_K_M-like mix first).
MIXED_TYPES = [
    {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K",
     "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K"},
    {"attn_q": "Q5_K", "attn_k": "Q8_0", "attn_v": "Q5_0", "attn_output": "IQ4_XS",
     "ffn_gate": "Q3_K", "ffn_up": "Q2_K", "ffn_down": "Q5_1"},
]
MIXED_HEAD, MIXED_EMBED = "Q6_K", "Q4_K"

# Half-precision scales that keep each type's weights at a typical model's size (~0.03).
_SCALES = {"Q4_0": 0.005, "Q4_1": 0.004, "Q5_0": 0.003, "Q5_1": 0.002, "Q8_0": 0.0004, "Q2_K": 0.004,
           "Q3_K": 0.0015, "Q4_K": 0.00012, "Q5_K": 0.00006, "Q6_K": 0.00002, "IQ4_NL": 0.0004,
           "IQ4_XS": 0.00002, "MXFP4": 0.008}

_KINDS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj"}


def write_header(writer: gguf.GGUFWriter, cfg) -> None:
    """The model fields llama.cpp's converter writes for a transformers config ``cfg``."""
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None)
    if head_dim and head_dim != cfg.hidden_size // cfg.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    # (Gemma 3 keeps one set per layer type: the file's base is the full layers')
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"] if "full_attention" in rope else rope["rope_theta"])


def blocks(type_name: str, shape: tuple[int, int], seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """Random blocks of ``type_name`` for a weight ``shape`` and that weight dequantised."""
    raw = random_blocks(type_name, shape, seed, _SCALES[type_name])
    return raw, split(type_name, raw, shape).dequantize()


def write_mixed_gguf(path: Path, arch: str = "qwen2", types: list[dict[str, str]] | None = None,
                     head: str = MIXED_HEAD, embed: str = MIXED_EMBED, tokenizer_fields: dict | None = None,
                     vocab_size: int = 256, seed: int = 0):
    """Write the file and return the transformers model with its weights (float32, eval).

    ``tokenizer_fields``: GGUF ``tokenizer.*`` fields to copy (a real vocabulary, whose
    size then is the model's); otherwise a byte-level stand-in of ``vocab_size`` tokens.
    """
    import transformers

    types = types or MIXED_TYPES
    tokens = tokenizer_fields["tokenizer.ggml.tokens"] if tokenizer_fields else [f"<t{i}>" for i in range(vocab_size)]
    vocab = len(tokens)
    cfg_cls, model_cls = {"qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                          "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM)}[arch]
    config = cfg_cls(vocab_size=vocab, tie_word_embeddings=False,
                     **{**MIXED_CONFIG, "num_hidden_layers": len(types)})
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    state = model.state_dict()
    writer = gguf.GGUFWriter(str(path), arch)
    write_header(writer, config)
    if tokenizer_fields:
        for key, value in tokenizer_fields.items():
            _add_field(writer, key, value)
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list(tokens)
    n = 0

    def quantised(name: str, hf: str, type_name: str, heads: int | None = None) -> None:
        nonlocal n
        shape = tuple(state[hf].shape)
        raw, w = blocks(type_name, shape, seed * 1000 + n)
        n += 1
        if heads is not None and arch == "llama":  # the file's rows are in llama.cpp's order
            w = torch.from_numpy(permute_back(w.numpy(), heads).copy())
        state[hf] = w
        writer.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[type_name])

    quantised("token_embd.weight", "model.embed_tokens.weight", embed)
    for i, layer in enumerate(types):
        for kind, hf in _KINDS.items():
            heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}.get(kind)
            quantised(f"blk.{i}.{kind}.weight", f"model.layers.{i}.{hf}.weight", layer[kind], heads)
        for kind, hf in (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")):
            w = 1 + 0.1 * torch.randn(config.hidden_size)
            state[f"model.layers.{i}.{hf}.weight"] = w
            writer.add_tensor(f"blk.{i}.{kind}.weight", w.numpy())
        if arch == "qwen2":
            for kind, hf in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj")):
                b = 0.1 * torch.randn(state[f"model.layers.{i}.self_attn.{hf}.bias"].shape)
                state[f"model.layers.{i}.self_attn.{hf}.bias"] = b
                writer.add_tensor(f"blk.{i}.{kind}.bias", b.numpy())
    norm = 1 + 0.1 * torch.randn(config.hidden_size)
    state["model.norm.weight"] = norm
    writer.add_tensor("output_norm.weight", norm.numpy())
    quantised("output.weight", "lm_head.weight", head)
    model.load_state_dict(state)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


def _add_field(writer: gguf.GGUFWriter, key: str, value) -> None:
    if isinstance(value, list):
        if value and isinstance(value[0], str):
            writer.add_array(key, value)
        elif value and isinstance(value[0], float):
            writer.add_array(key, [float(v) for v in value])
        else:
            writer.add_array(key, [int(v) for v in value])
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)

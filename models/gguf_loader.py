"""GGUF files: metadata -> ModelConfig, tensors -> dequantised HF-named weights."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.config import ModelConfig
from models.gemma4_config import gemma4_gguf_config
from models.gguf_quants import SPLIT_TYPES
from models.gguf_reader import GGMLQuantizationType, GGUFFile, GGUFTensor, read_gguf
from models.moe_config import GGUF_MOE_ARCHITECTURES, gguf_moe_fields

# Types we dequantise (with the `gguf` package's reference code): the float ones and the
# quantised ones models.gguf_quants splits into codes and scales (what w4a16 keeps).
SUPPORTED_QUANT_TYPES = ("F32", "F16", "BF16", *SPLIT_TYPES)

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                 "gemma3": "Gemma3ForCausalLM", "gemma4": "Gemma4ForCausalLM"}
# Where a family's tensor kinds name other modules than Llama's: Phi-3's ffn_up is its fused
# gate and up (gate first; models.fused splits it at load); Gemma's ffn_norm is the norm
# before its MLP, and it has a norm after the attention and after the MLP.
_GEMMA_NORMS = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
_ARCH_LAYER_NAMES = {
    "Phi3ForCausalLM": {"ffn_up": "mlp.gate_up_proj"},
    "Gemma2ForCausalLM": _GEMMA_NORMS,
    "Gemma3ForCausalLM": _GEMMA_NORMS,
    # (Gemma 4's per-layer input: its gate, projection and norm; layer_output_scale: see hf_name)
    "Gemma4ForCausalLM": {**_GEMMA_NORMS, "inp_gate": "per_layer_input_gate", "proj": "per_layer_projection",
                          "post_norm": "post_per_layer_input_norm", "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
                          "post_ffw_norm_1": "post_feedforward_layernorm_1",
                          "post_ffw_norm_2": "post_feedforward_layernorm_2", "ffn_gate_inp": "router.proj"},
    # (gpt-oss's norm before its experts is llama.cpp's post_attention_norm; sinks: one per head)
    "GptOssForCausalLM": {"post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks"},
}
# Gemma's files carry no layer pattern: llama.cpp's, Gemma 2's every other layer full, Gemma 3's
# every sixth, the rest windowed.
GEMMA_FULL_EVERY = {"gemma2": 2, "gemma3": 6}
# Tensors that hold RoPE settings, read into the config (not weights).
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# llama.cpp permutes only llama-arch Q/K (Qwen's RoPE already rotates halves, as HF's).
# (Mixtral is llama.cpp's `llama` with experts; Granite MoE's converter is Llama's.)
PERMUTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "GraniteMoeForCausalLM")

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 4's per-layer parameters without a module's .weight: (kind, suffix) -> HF name.
_GEMMA4_PARAMETERS = {("layer_output_scale", "weight"): "layer_scalar", ("ffn_gate_inp", "scale"): "router.scale",
                      ("ffn_down_exps", "scale"): "router.per_expert_scale",
                      ("ffn_gate_up_exps", "weight"): "experts.gate_up_proj",
                      ("ffn_gate_exps", "weight"): "experts.gate_proj", ("ffn_up_exps", "weight"): "experts.up_proj",
                      ("ffn_down_exps", "weight"): "experts.down_proj"}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    # Gemma 4's per-layer input embeddings
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
}


def open_gguf(path: str | Path) -> GGUFFile:
    """Open a GGUF file, turning a damaged or foreign file into a ``ValueError``."""
    try:
        return read_gguf(path)
    except (ValueError, OSError) as exc:
        raise ValueError(f"not a readable GGUF file (truncated or corrupt?): {exc}") from exc  # exc names the path


def field_value(reader: GGUFFile, key: str, default: Any = None) -> Any:
    """One metadata value (scalar, string or list), or ``default`` if absent."""
    return reader.fields.get(key, default)


def _f32_values(tensor: GGUFTensor) -> tuple[float, ...]:
    if tensor.tensor_type != GGMLQuantizationType.F32:
        raise ValueError(f"{tensor.name} is of type {GGMLQuantizationType(tensor.tensor_type).name}; "
                         "llama.cpp writes it as F32")
    return tuple(float(f) for f in np.asarray(tensor.data).view("<f4"))


def _rope_scaling(get: Any, rope: dict[str, tuple[float, ...]]) -> dict[str, Any] | None:
    """A GGUF file's ``rope.scaling.*`` fields (and Phi-3's ``rope_factors_long/short``
    tensors: LongRoPE) as a transformers ``rope_scaling`` (None: unscaled). llama.cpp's
    converter writes linear and YaRN scaling so; Llama 3.1's goes into the ``rope_freqs``
    tensor instead (``ModelConfig.rope_freq_factors``)."""
    if "rope_factors_long.weight" in rope or "rope_factors_short.weight" in rope:
        scaling = {"rope_type": "longrope", "long_factor": list(rope.get("rope_factors_long.weight", ())),
                   "short_factor": list(rope.get("rope_factors_short.weight", ())),
                   "original_max_position_embeddings": get("rope.scaling.original_context_length"),
                   "attention_factor": get("rope.scaling.attn_factor")}
        return {k: v for k, v in scaling.items() if v is not None}
    scaling_type = get("rope.scaling.type")
    if scaling_type in (None, "none"):
        return None
    if scaling_type not in ("linear", "yarn"):
        raise ValueError(f"GGUF rope scaling {scaling_type!r} is not supported (linear and yarn are)")
    scaling = {"rope_type": scaling_type, "factor": get("rope.scaling.factor")}
    if scaling_type == "yarn":
        optional = {"original_max_position_embeddings": get("rope.scaling.original_context_length"),
                    "attention_factor": get("rope.scaling.attn_factor"),
                    "beta_fast": get("rope.scaling.yarn_beta_fast"), "beta_slow": get("rope.scaling.yarn_beta_slow")}
        scaling.update({k: v for k, v in optional.items() if v is not None})
    return scaling


def config_from_gguf(reader: GGUFFile) -> ModelConfig:
    """Translate GGUF metadata into a ModelConfig."""
    arch = field_value(reader, "general.architecture")
    if arch not in ARCHITECTURES and arch not in GGUF_MOE_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")

    def get(key: str, default: Any = None) -> Any:
        return field_value(reader, f"{arch}.{key}", default)

    hidden = get("embedding_length")
    heads = get("attention.head_count")
    if hidden is None or heads is None or get("block_count") is None:
        raise ValueError(f"GGUF metadata lacks {arch}.embedding_length/block_count/attention.head_count")
    tokens = field_value(reader, "tokenizer.ggml.tokens") or []
    names = {t.name for t in reader.tensors}
    rope = {t.name: _f32_values(t) for t in reader.tensors if t.name in ROPE_TENSORS}
    if arch == "gemma4":
        return _gemma4_config(reader, get, names, rope, len(tokens))
    # A sliding window over every layer (llama.cpp writes one for Phi-3-mini-4k); none where
    # it covers the whole context.
    window, layers = get("attention.sliding_window") or 0, get("block_count")
    windows = (window,) * layers if 0 < window < get("context_length", 2048) else ()
    gemma = {}
    if arch in GEMMA_FULL_EVERY:
        gemma = _gemma_settings(arch, get, hidden, heads)
        window = window or 4096  # (llama.cpp's default for a Gemma 2 file without one)
        windows = tuple(0 if (i + 1) % GEMMA_FULL_EVERY[arch] == 0 else window for i in range(layers))
    rope_scaling = _rope_scaling(get, rope)
    if arch == "gpt-oss":
        # llama.cpp's gpt-oss: the even layers windowed, the odd ones full; its YaRN, as
        # transformers' config for it, does not round the ramp's ends (truncate: false).
        windows = tuple(window if i % 2 == 0 else 0 for i in range(layers)) if window else ()
        if rope_scaling is not None and rope_scaling.get("rope_type") == "yarn":
            rope_scaling = {**rope_scaling, "truncate": False}
    eos = field_value(reader, "tokenizer.ggml.eos_token_id")
    eot = field_value(reader, "tokenizer.ggml.eot_token_id")
    eos_ids = tuple(dict.fromkeys(i for i in (eos, eot) if i is not None))
    head_dim = get("attention.key_length") or hidden // heads
    # Phi-4-mini turns 3/4 of each head (llama.cpp's rope.dimension_count; its NEOX rope pairs
    # the turned rows' halves, as transformers does)
    turned = get("rope.dimension_count") if arch == "phi3" else None
    config = ModelConfig(
        architecture=ARCHITECTURES.get(arch, "LlamaForCausalLM"),
        vocab_size=get("vocab_size") or len(tokens),
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_hidden_layers=get("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=get("attention.head_count_kv") or heads,
        head_dim=head_dim,
        rotary_dim=turned if turned and turned < head_dim else 0,
        max_position_embeddings=get("context_length", 2048),
        rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=get("rope.freq_base", 10000.0),
        rope_scaling=rope_scaling,
        rope_freq_factors=rope.get("rope_freqs.weight"),
        layer_windows=windows,
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm=arch in ("qwen3", "gemma3"),
        bos_token_id=field_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos_ids,
        **gemma,
    )
    if not get("expert_count"):
        return config
    # A mixture of experts (models/moe_config.py); Mixtral's arch is `llama`
    return replace(config, **gguf_moe_fields(arch, get, names, layers, config.intermediate_size))


def _gemma4_config(reader: GGUFFile, get: Any, names: set[str], rope: dict[str, tuple[float, ...]],
                   tokens: int) -> ModelConfig:
    """A Gemma 4 file's config, through the config.json reading (``gemma4_gguf_config``)."""
    rows = next((int(t.shape[1]) for t in reader.tensors if t.name == "per_layer_token_embd.weight"), None)
    cfg = gemma4_gguf_config(get, names, rope.get("rope_freqs.weight"), rows)
    eos = [i for i in (field_value(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot")) if i is not None]
    cfg.update(vocab_size=get("vocab_size") or tokens, bos_token_id=field_value(reader, "tokenizer.ggml.bos_token_id"),
               eos_token_id=list(dict.fromkeys(eos)))
    return ModelConfig.from_hf(cfg)


def _gemma_settings(arch: str, get: Any, hidden: int, heads: int) -> dict[str, Any]:
    """A Gemma 2 or 3 file's ModelConfig fields beyond Llama's, as llama.cpp reads them. Its
    norms hold 1 + w already (llama.cpp's converter added the 1): no norm offset."""
    head_dim = get("attention.key_length") or hidden // heads
    # The files keep no query_pre_attn_scalar: llama.cpp's, hidden / heads for the 27B
    # models (46 layers: Gemma 2; 62: Gemma 3), head_dim for the others.
    big = get("block_count") == {"gemma2": 46, "gemma3": 62}[arch]
    scale = (hidden // heads if big else head_dim) ** -0.5
    if arch == "gemma3":
        return dict(attention_scale=scale, local_rope_theta=get("rope.freq_base_swa", 10000.0))
    # (llama.cpp's defaults where a Gemma 2 file leaves a cap out)
    return dict(attention_scale=scale, attn_logit_softcap=get("attn_logit_softcapping", 50.0),
                final_logit_softcap=get("final_logit_softcapping", 30.0))


def hf_name(gguf_name: str, architecture: str | None = None) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` (in
    ``architecture``'s names: ``_ARCH_LAYER_NAMES``)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if architecture == "Gemma4ForCausalLM" and len(parts) == 4 and (parts[2], parts[3]) in _GEMMA4_PARAMETERS:
        # (Gemma 4's parameters of their own, no .weight; its stacked experts, split at load)
        return f"model.layers.{parts[1]}.{_GEMMA4_PARAMETERS[parts[2], parts[3]]}"
    names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(architecture or "", {})}
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} is not part of a supported Llama-family model")


def dequantize(tensor: GGUFTensor) -> np.ndarray:
    """A GGUF tensor as float32, shaped like the HF weight (rows = output features)."""
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType(tensor.tensor_type)
    if qtype.name not in SUPPORTED_QUANT_TYPES:
        raise ValueError(f"tensor {tensor.name!r} uses quantisation type {qtype.name}, which kvserve "
                         f"cannot load; supported: {', '.join(SUPPORTED_QUANT_TYPES)}")
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
    if qtype.name == "F32":
        data = np.asarray(tensor.data, dtype=np.float32)
    elif qtype.name == "F16":
        data = np.asarray(tensor.data, dtype=np.float16).astype(np.float32)
    else:
        data = quants.dequantize(tensor.data, qtype)
    if data.size != int(np.prod(shape)):
        raise ValueError(f"tensor {tensor.name!r} holds {data.size} values, expected shape {shape}")
    return data.reshape(shape)


def permute_back(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's converter interleaves each head's rotary halves of Q and K
    # (its RoPE rotates adjacent pairs): [head, half, 2] -> HF's [head, 2, half].
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# GGUF types whose 4-bit codes survive requantisation to int4 groups of 32.
FOUR_BIT_TYPES = ("Q4_0", "Q4_1", "Q4_K")


def projection_type(reader: GGUFFile) -> str:
    """The GGUF type of the first layer's FFN down projection, e.g. ``"Q4_1"``.

    Quantised files keep most projections at one type; this one stands for them.
    """
    from gguf import GGMLQuantizationType

    for tensor in reader.tensors:
        if tensor.name in ("blk.0.ffn_down.weight", "blk.0.ffn_down_exps.weight"):
            return GGMLQuantizationType(tensor.tensor_type).name
    raise ValueError("GGUF file has no blk.0.ffn_down.weight tensor")


def iter_gguf_weights(reader: GGUFFile, config: ModelConfig,
                      skip: set[str] | frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, float32 tensor)`` for every tensor of the file but those named in ``skip``."""
    permute = config.architecture in PERMUTED_ARCHITECTURES
    for t in reader.tensors:
        if t.name in ROPE_TENSORS or t.name in skip:
            continue
        name = hf_name(t.name, config.architecture)
        w = dequantize(t)
        if permute and ".q_proj." in name:
            w = permute_back(w, config.num_attention_heads)
        elif permute and ".k_proj." in name:
            w = permute_back(w, config.num_key_value_heads)
        # Mapped F32 tensors are read-only views of the file; torch wants writable memory.
        yield name, torch.from_numpy(np.array(w, dtype=np.float32, order="C", copy=not w.flags.writeable))

"""Gemma 4 (text) from its config.json: what ``ModelConfig`` carries beyond Gemma 3's.

``gemma4_text_config`` rewrites the config into the fields Gemma 3's reading understands
(one RoPE set per layer type, whole-head rotation) and returns the settings only Gemma 4
has (``Gemma4Settings``, read by ``models.gemma4``), and each layer's KV heads and head size
(``ModelConfig.layer_attention``: every published Gemma 4's full layers have
``global_head_dim`` 512 beside the windowed layers' 256). What kvserve cannot run is a
``ValueError`` naming it: bidirectional attention, and a GGUF file of the experts' model.

No import of ``models.config`` (which imports this module).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from models.moe_config import MoESettings

GEMMA4_ARCHITECTURE = "Gemma4ForCausalLM"


@dataclass(frozen=True)
class Gemma4Settings:
    """Gemma 4's layer options (transformers' names in brackets)."""

    # Per-layer input embeddings: each layer adds a gated projection of a vector of this
    # size, from its own embedding table and the token's embedding [hidden_size_per_layer_input]
    # (0: none), whose table has ``per_layer_vocab_size`` rows [vocab_size_per_layer_input].
    per_layer_size: int
    per_layer_vocab_size: int
    # The layer whose keys and values each layer attends to: itself, but in the last
    # [num_kv_shared_layers], which reuse the last earlier layer's of their type.
    kv_source: tuple[int, ...]
    # The full-attention layers' values are their keys' projection [attention_k_eq_v].
    values_from_keys: bool
    # Each layer's MLP width: twice intermediate_size in the KV-sharing layers [use_double_wide_mlp].
    mlp_sizes: tuple[int, ...]
    # The 26B-A4B's experts beside every layer's MLP [enable_moe_block, num_experts,
    # top_k_experts, moe_intermediate_size]: a softmax over all experts, the k largest
    # renormalised, then each scaled by its own factor (models.gemma4); None: none.
    experts: MoESettings | None = None

    def shares_kv(self, index: int) -> bool:
        """Whether layer ``index`` reads another layer's keys and values (it has no K/V projection)."""
        return self.kv_source[index] != index


def _refuse_unsupported(cfg: dict[str, Any]) -> None:
    """A ValueError naming what of Gemma 4 kvserve does not run."""
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"Gemma 4's bidirectional attention (use_bidirectional_attention="
                         f"{cfg['use_bidirectional_attention']!r}) is not supported: kvserve's attention is causal")
    if cfg.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation {cfg['hidden_activation']!r} is not supported (gelu_pytorch_tanh is)")


def _layer_attention(cfg: dict[str, Any], types: list[str]) -> tuple[tuple[int, int], ...]:
    """Each layer's ``(KV heads, head size)`` as transformers reads them (empty when no
    layer's differ): a saved ``per_layer_config`` (layer index -> overrides), else the full
    layers' ``global_head_dim`` (512 unless given) and, with ``attention_k_eq_v``, their
    ``num_global_key_value_heads``."""
    head_dim, kv_heads = cfg.get("head_dim", 256), cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    if "per_layer_config" in cfg:
        overrides = {int(k): dict(v) for k, v in (cfg["per_layer_config"] or {}).items()}
    else:
        full = {"head_dim": cfg.get("global_head_dim", 512)}
        if cfg.get("attention_k_eq_v", False) and cfg.get("num_global_key_value_heads") is not None:
            full["num_key_value_heads"] = cfg["num_global_key_value_heads"]
        overrides = {i: full for i, kind in enumerate(types) if kind == "full_attention"}
    for layer, o in overrides.items():
        other = sorted(set(o) - {"head_dim", "num_key_value_heads"})
        if other or not 0 <= layer < len(types):
            raise ValueError(f"Gemma 4's per_layer_config for layer {layer} sets {', '.join(other) or 'a layer'} "
                             f"kvserve does not read (it reads head_dim and num_key_value_heads of layers 0-"
                             f"{len(types) - 1})")
    shapes = tuple((overrides.get(i, {}).get("num_key_value_heads", kv_heads),
                    overrides.get(i, {}).get("head_dim", head_dim)) for i in range(len(types)))
    return shapes if len(set(shapes)) > 1 else ()


def _kv_sources(types: list[str], shared: int) -> tuple[int, ...]:
    """transformers' ``kv_sharing_modes``: the last ``shared`` layers reuse the K/V of the last
    earlier layer of their type."""
    first = len(types) - shared
    sources = list(range(len(types)))
    for i in range(first, len(types)):
        earlier = [j for j in range(first) if types[j] == types[i]]
        if not earlier:
            raise ValueError(f"Gemma 4 layer {i} ({types[i]}) shares the K/V of no earlier layer of its type "
                             f"(num_kv_shared_layers {shared} of {len(types)} layers)")
        sources[i] = earlier[-1]
    return tuple(sources)


def _full_rope(full: dict[str, Any], head_dim: int) -> tuple[float, tuple[float, ...] | None]:
    """The full-attention layers' base and per-pair frequency divisors (``ModelConfig.rope_freq_factors``).

    Proportional RoPE turns the first ``partial_rotary_factor`` of a head's pairs at the
    default frequencies (of the whole head size) and leaves the others unturned: a divisor
    of infinity makes a pair's frequency 0, a rotation by nothing.
    """
    rope_type = full.get("rope_type", "default")
    theta = full.get("rope_theta", 1_000_000.0)
    if rope_type == "default":
        return theta, None
    if rope_type != "proportional":
        raise ValueError(f"Gemma 4 full-attention rope_type {rope_type!r} is not supported (default, proportional)")
    pairs = head_dim // 2
    turned = int(full.get("partial_rotary_factor", 1.0) * head_dim // 2)
    factor = full.get("factor", 1.0)
    return theta, (factor,) * turned + (math.inf,) * (pairs - turned)


def gemma4_text_config(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(cfg, overrides)``: the config.json rewritten as Gemma 3's reading takes it, and the
    ``ModelConfig`` fields to set over what that reading gives."""
    _refuse_unsupported(cfg)
    layers, head_dim = cfg["num_hidden_layers"], cfg.get("head_dim", 256)
    types = list(cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention"
                                            for i in range(layers)])
    shapes = _layer_attention(cfg, types)
    full_dims = {shapes[i][1] for i in range(layers) if types[i] == "full_attention"} if shapes else {head_dim}
    if len(full_dims) != 1 or (shapes and len({shapes[i][1] for i in range(layers)
                                               if types[i] != "full_attention"} - {head_dim})):
        raise ValueError(f"Gemma 4's layers of one type must share a head size (the windowed ones head_dim "
                         f"{head_dim}), got {[d for _, d in shapes]}")
    rope = cfg.get("rope_parameters") or {}
    sliding = dict(rope.get("sliding_attention") or {"rope_type": "default", "rope_theta": 10_000.0})
    if sliding.get("rope_type", "default") != "default":
        raise ValueError(f"Gemma 4 sliding-attention rope_type {sliding['rope_type']!r} is not supported (default)")
    theta, factors = _full_rope(rope.get("full_attention") or
                                {"rope_type": "proportional", "partial_rotary_factor": 0.25}, full_dims.pop())
    sources = _kv_sources(types, cfg.get("num_kv_shared_layers", 0))
    wide = cfg.get("use_double_wide_mlp", False)
    inter = cfg["intermediate_size"]
    settings = Gemma4Settings(
        per_layer_size=cfg.get("hidden_size_per_layer_input", 256) or 0,
        per_layer_vocab_size=cfg.get("vocab_size_per_layer_input", cfg["vocab_size"]),
        kv_source=sources,
        values_from_keys=bool(cfg.get("attention_k_eq_v", False)),
        mlp_sizes=tuple(inter * (2 if wide and sources[i] != i else 1) for i in range(layers)),
        experts=MoESettings(num_experts=cfg["num_experts"], experts_per_token=cfg["top_k_experts"],
                            expert_size=cfg["moe_intermediate_size"]) if cfg.get("enable_moe_block") else None)
    rewritten = {**cfg, "layer_types": types, "sliding_window": cfg.get("sliding_window", 512),
                 "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": theta},
                                     "sliding_attention": sliding}}
    # Gemma 4's norms scale by w (not 1 + w), and its queries are not scaled (their norm is).
    overrides = dict(attention_scale=1.0, norm_offset=0.0, local_rope_theta=sliding.get("rope_theta", 10_000.0),
                     rope_freq_factors=factors, qk_norm=True,
                     tie_word_embeddings=cfg.get("tie_word_embeddings", True),
                     final_logit_softcap=cfg.get("final_logit_softcapping") or 0.0, gemma4=settings,
                     layer_attention=shapes)
    return rewritten, overrides


def gemma4_gguf_config(get: Callable[..., Any], names: set[str], rope_freqs: tuple[float, ...] | None,
                       per_layer_rows: int | None) -> dict[str, Any]:
    """A Gemma 4 GGUF file's metadata (``get(key)``: ``gemma4.<key>``) as the config.json
    ``gemma4_text_config`` reads, as llama.cpp's converter writes it: the full layers' head
    size in ``attention.key_length`` and the windowed ones' in ``key_length_swa``; KV heads and
    MLP widths per layer where they differ; the layer pattern as one flag per layer; no
    ``attn_v`` in a full layer whose values are its keys; the full layers' proportional RoPE
    as ``rope_freqs`` (1 for a turned pair, 1e30 for the others); norms as they are (w); the
    26B-A4B's ``expert_count``, ``expert_used_count`` and ``expert_feed_forward_length``."""
    layers, heads = get("block_count"), get("attention.head_count")
    pattern = get("attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) != layers:
        raise ValueError(f"a Gemma 4 GGUF gives each layer's kind in gemma4.attention.sliding_window_pattern "
                         f"({layers} flags), got {pattern!r}")
    types = ["sliding_attention" if swa else "full_attention" for swa in pattern]
    full_dim, swa_dim = get("attention.key_length"), get("attention.key_length_swa") or get("attention.key_length")
    kv = get("attention.head_count_kv") or heads
    kv = kv if isinstance(kv, list) else [kv] * layers
    swa_kv = next((kv[i] for i in range(layers) if pattern[i]), kv[0])
    ff = get("feed_forward_length")
    ff = ff if isinstance(ff, list) else [ff] * layers
    shared = get("attention.shared_kv_layers", 0) or 0
    first_shared = layers - shared
    wide = any(ff[i] != ff[0] for i in range(layers))
    if wide and any(ff[i] != ff[0] * (2 if i >= first_shared else 1) for i in range(layers)):
        raise ValueError(f"Gemma 4 GGUF MLP widths {ff} are not one width with twice it in the KV-sharing layers")
    full = [i for i in range(layers) if not pattern[i]]
    k_eq_v = bool(full) and all(f"blk.{i}.attn_v.weight" not in names for i in full if i < first_shared)
    turned = None
    if rope_freqs is not None:
        turned = next((i for i, f in enumerate(rope_freqs) if f != 1.0), len(rope_freqs))
        if any(f < 1e29 for f in rope_freqs[turned:]):
            raise ValueError("a Gemma 4 GGUF's rope_freqs must be 1 for its first pairs and 1e30 for the others "
                             "(llama.cpp's proportional RoPE)")
    theta = get("rope.freq_base", 1_000_000.0)
    full_rope = ({"rope_type": "default", "rope_theta": theta} if turned is None else
                 {"rope_type": "proportional", "partial_rotary_factor": 2 * turned / full_dim, "rope_theta": theta})
    return {
        "architectures": [GEMMA4_ARCHITECTURE], "hidden_size": get("embedding_length"), "num_hidden_layers": layers,
        "intermediate_size": ff[0], "use_double_wide_mlp": wide, "num_attention_heads": heads,
        "num_key_value_heads": swa_kv, "head_dim": swa_dim,
        "per_layer_config": {str(i): {"head_dim": full_dim, "num_key_value_heads": kv[i]} for i in full},
        "attention_k_eq_v": k_eq_v, "layer_types": types, "sliding_window": get("attention.sliding_window", 512),
        "num_kv_shared_layers": shared, "max_position_embeddings": get("context_length", 131072),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_parameters": {"full_attention": full_rope,
                            "sliding_attention": {"rope_type": "default",
                                                  "rope_theta": get("rope.freq_base_swa", 10_000.0)}},
        "final_logit_softcapping": get("final_logit_softcapping"),
        "hidden_size_per_layer_input": get("embedding_length_per_layer_input", 0) or 0,
        "tie_word_embeddings": "output.weight" not in names,
        **({"vocab_size_per_layer_input": per_layer_rows} if per_layer_rows else {}),
        **({"enable_moe_block": True, "num_experts": get("expert_count"), "top_k_experts": get("expert_used_count"),
            "moe_intermediate_size": get("expert_feed_forward_length")} if get("expert_count") else {}),
    }

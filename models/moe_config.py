"""The mixture-of-experts settings of a model (``ModelConfig.moe``), from config.json or GGUF metadata.

Kept apart from ``models.config`` so that the dense families' config stays as it was:
``moe_fields`` and ``gguf_moe_fields`` give these settings (and the few attention settings
the MoE families change) as ``ModelConfig`` fields to replace in the one the dense code built.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM",
                     "GraniteMoeForCausalLM", "GptOssForCausalLM")
# GGUF general.architecture -> HF architecture (Mixtral is llama.cpp's `llama` with experts).
GGUF_MOE_ARCHITECTURES = {"qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
                          "olmoe": "OlmoeForCausalLM", "granitemoe": "GraniteMoeForCausalLM",
                          "gpt-oss": "GptOssForCausalLM"}
# Routers: "softmax-topk" takes the k largest probabilities of a softmax over every expert
# (Mixtral, Qwen, OLMoE); "topk-softmax" a softmax over the k largest logits (Granite, gpt-oss).
ROUTERS = ("softmax-topk", "topk-softmax")


@dataclass(frozen=True)
class MoESettings:
    """How a model's sparse MLP blocks route and what they hold."""

    num_experts: int
    experts_per_token: int
    expert_size: int  # each expert's intermediate features
    # Renormalise the chosen experts' weights to sum to 1 (softmax-topk routers).
    norm_topk_prob: bool = True
    router: str = "softmax-topk"
    # Qwen2-MoE's shared expert: an MLP every token runs, scaled by sigmoid(gate(x)). 0: none.
    shared_expert_size: int = 0
    # Per layer, whether its MLP is sparse (Qwen's decoder_sparse_step, mlp_only_layers);
    # empty: every layer. A dense layer's MLP has ``ModelConfig.intermediate_size`` features.
    sparse_layers: tuple[bool, ...] = ()
    # OLMoE: one RMSNorm over the whole query projection and one over the whole key
    # projection (not per head, as Qwen3's ``qk_norm``).
    qk_norm_projection: bool = False
    # Granite's multipliers: the embedding, each residual branch, and the logits' divisor.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # gpt-oss: the router and every expert projection carry a bias; the experts' activation
    # is (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)
    # (0: SiLU gating, the others'); each attention head has a sink logit, and the output
    # projection a bias.
    biases: bool = False
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.0
    attention_sinks: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"experts per token ({self.experts_per_token}) must be between 1 and the "
                             f"number of experts ({self.num_experts})")
        if self.router not in ROUTERS:
            raise ValueError(f"unknown router {self.router!r}; supported: {', '.join(ROUTERS)}")

    def is_sparse(self, layer: int) -> bool:
        """Whether layer ``layer``'s MLP is an experts block."""
        return self.sparse_layers[layer] if self.sparse_layers else True


def _sparse_layers(cfg: dict[str, Any]) -> tuple[bool, ...]:
    """Qwen-MoE's choice of sparse layers, as transformers makes it."""
    step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or ())
    layers = [i not in dense and step > 0 and (i + 1) % step == 0 for i in range(cfg["num_hidden_layers"])]
    return () if all(layers) else tuple(layers)


def moe_fields(cfg: dict[str, Any], arch: str, head_dim: int) -> dict[str, Any]:
    """The ``ModelConfig`` fields an MoE family's config.json ``cfg`` sets beyond a dense
    model's: ``moe`` and the attention settings it changes."""
    if arch == "GptOssForCausalLM":
        return _gpt_oss_fields(cfg)
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported for {arch} (silu is)")
    if cfg.get("clip_qkv") is not None:
        raise ValueError(f"clip_qkv {cfg['clip_qkv']} is not supported (OLMoE's clipping of q, k and v)")
    common = dict(num_experts=cfg.get("num_local_experts", cfg.get("num_experts")),
                  experts_per_token=cfg["num_experts_per_tok"])
    fields: dict[str, Any] = {}
    if arch in ("MixtralForCausalLM", "GraniteMoeForCausalLM"):
        moe = MoESettings(**common, expert_size=cfg["intermediate_size"], norm_topk_prob=True,
                          router="topk-softmax" if arch == "GraniteMoeForCausalLM" else "softmax-topk",
                          embedding_multiplier=cfg.get("embedding_multiplier", 1.0),
                          residual_multiplier=cfg.get("residual_multiplier", 1.0),
                          logits_scaling=cfg.get("logits_scaling", 1.0))
        if arch == "GraniteMoeForCausalLM":
            fields["attention_scale"] = cfg.get("attention_multiplier", head_dim ** -0.5)
    elif arch == "OlmoeForCausalLM":
        moe = MoESettings(**common, expert_size=cfg["intermediate_size"],
                          norm_topk_prob=cfg.get("norm_topk_prob", False), qk_norm_projection=True)
    else:  # Qwen2-MoE, Qwen3-MoE
        qwen2 = arch == "Qwen2MoeForCausalLM"
        moe = MoESettings(**common, expert_size=cfg["moe_intermediate_size"],
                          norm_topk_prob=cfg.get("norm_topk_prob", not qwen2),
                          shared_expert_size=cfg.get("shared_expert_intermediate_size", 0) if qwen2 else 0,
                          sparse_layers=_sparse_layers(cfg))
        fields["qk_norm"] = not qwen2
        if qwen2:
            fields["attention_bias"] = cfg.get("qkv_bias", True)
    return {**fields, "moe": moe}


def _gpt_oss_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss's fields (its config.json's experts hold their own activation: hidden_act is
    not read, as transformers does not)."""
    if cfg.get("quantization_config"):
        raise ValueError("gpt-oss checkpoints with MXFP4 experts (quantization_config) are not read from a "
                         "directory here: use the model's GGUF file, or a dequantised (bfloat16) checkpoint")
    moe = MoESettings(num_experts=cfg["num_local_experts"], experts_per_token=cfg["num_experts_per_tok"],
                      expert_size=cfg["intermediate_size"], router="topk-softmax", biases=True,
                      swiglu_limit=cfg.get("swiglu_limit", 7.0), swiglu_alpha=cfg.get("swiglu_alpha", 1.702),
                      attention_sinks=True)
    return {"attention_bias": cfg.get("attention_bias", True), "moe": moe}


# llama.cpp's gpt-oss graph fixes these (ggml's swiglu_oai), they are not in the file.
GGUF_GPT_OSS_SWIGLU = dict(swiglu_limit=7.0, swiglu_alpha=1.702)


def gguf_moe_fields(arch: str, get: Callable[..., Any], names: set[str], layers: int,
                    intermediate_size: int | None) -> dict[str, Any]:
    """The ``ModelConfig`` fields of a GGUF MoE file of llama.cpp architecture ``arch`` beyond
    a dense model's, from ``{arch}.expert_*`` (``get`` reads a key under ``arch``) and its
    tensor ``names``: the HF architecture, ``moe`` and the attention settings it changes."""
    count, used = get("expert_count"), get("expert_used_count")
    if not count or not used:
        raise ValueError(f"GGUF metadata lacks {arch}.expert_count/expert_used_count of an MoE model")
    hf = GGUF_MOE_ARCHITECTURES.get(arch, "MixtralForCausalLM")
    gpt_oss = hf == "GptOssForCausalLM"
    # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX (1), or gpt-oss's softmax over the chosen (3)
    if get("expert_gating_func") not in (None, 3 if gpt_oss else 1):
        raise ValueError(f"{arch}.expert_gating_func {get('expert_gating_func')} is not supported (softmax, 1, is)")
    expert_size = get("expert_feed_forward_length") or intermediate_size
    # llama.cpp normalises the chosen weights for Mixtral and Qwen3-MoE, not for Qwen2-MoE and OLMoE.
    norm = get("expert_weights_norm", hf in ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "GraniteMoeForCausalLM"))
    shared = (get("expert_shared_feed_forward_length") or 0) if "blk.0.ffn_up_shexp.weight" in names else 0
    # (llama.cpp runs every Qwen2-MoE layer sparse; a file without a layer's router has a dense one)
    sparse = tuple(f"blk.{i}.ffn_gate_inp.weight" in names for i in range(layers))
    fields: dict[str, Any] = {}
    moe = MoESettings(num_experts=count, experts_per_token=used, expert_size=expert_size, norm_topk_prob=bool(norm),
                      sparse_layers=() if all(sparse) else sparse,
                      router="topk-softmax" if hf in ("GraniteMoeForCausalLM", "GptOssForCausalLM") else "softmax-topk",
                      shared_expert_size=shared, qk_norm_projection=hf == "OlmoeForCausalLM",
                      embedding_multiplier=get("embedding_scale", 1.0), residual_multiplier=get("residual_scale", 1.0),
                      logits_scaling=get("logit_scale", 1.0),
                      **(dict(biases=True, attention_sinks=True, **GGUF_GPT_OSS_SWIGLU) if gpt_oss else {}))
    if hf == "GraniteMoeForCausalLM" and get("attention.scale") is not None:
        fields["attention_scale"] = get("attention.scale")
    # (Qwen3-MoE: a norm per head; OLMoE: over the whole projections, qk_norm_projection)
    fields["qk_norm"] = hf == "Qwen3MoeForCausalLM"
    if gpt_oss:
        fields["attention_bias"] = True
    return {**fields, "architecture": hf, "intermediate_size": intermediate_size or expert_size, "moe": moe}

"""The shape of a decoder-only model, read from an HF config or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from models.gemma4_config import GEMMA4_ARCHITECTURE, Gemma4Settings, gemma4_text_config
from models.moe_config import MOE_ARCHITECTURES, MoESettings, moe_fields

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Phi3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", GEMMA4_ARCHITECTURE,
                           *MOE_ARCHITECTURES)
# The Gemma families (models/gemma.py): Gemma's norms, MLP and settings (_gemma_settings).
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")
# What each rope_scaling type must give (models/rope.py computes the tables from them).
_ROPE_REQUIRED = {"linear": ("factor",), "llama3": ("factor", "original_max_position_embeddings"),
                  "longrope": ("long_factor", "short_factor", "original_max_position_embeddings"),
                  "yarn": ("factor",), "dynamic": ("factor",)}
# A base model saved without its LM head (transformers' AutoModel, as embedding models
# are published) runs as its causal-LM class: the same layers.
_BASE_MODELS = {arch.removesuffix("ForCausalLM") + "Model": arch for arch in SUPPORTED_ARCHITECTURES}


def _layer_windows(cfg: dict[str, Any], arch: str) -> tuple[int, ...]:
    """Each layer's sliding window from a config.json (empty: none), as transformers reads
    it: ``layer_types`` where given; else Mistral v0.1, Mixtral and Phi-3 window every layer, Qwen2
    (with ``use_sliding_window``) the layers from ``max_window_layers`` on, Gemma 2 every
    other one from the first. A window that covers the whole context is none."""
    window = cfg.get("sliding_window")
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    # (Gemma's windowed layers keep their window, whatever the context: it names their RoPE base too)
    if not window or (window >= cfg.get("max_position_embeddings", 0)
                      and arch not in ("Gemma3ForCausalLM", GEMMA4_ARCHITECTURE)):
        return ()
    if types is not None:
        windowed = [t == "sliding_attention" for t in types]
    elif arch == "Gemma2ForCausalLM":
        windowed = [i % 2 == 0 for i in range(layers)]
    elif arch == "Qwen2ForCausalLM":
        first = cfg.get("max_window_layers", layers)
        windowed = [cfg.get("use_sliding_window", False) and i >= first for i in range(layers)]
    else:
        every = arch in ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM")
        windowed = [cfg.get("use_sliding_window", every)] * layers
    return tuple(window if w else 0 for w in windowed) if any(windowed) else ()


def _gemma_settings(cfg: dict[str, Any], arch: str, local_rope: dict[str, Any] | None) -> dict[str, Any]:
    """Gemma 2's and 3's ModelConfig fields beyond Llama's, from its config.json."""
    if cfg.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation {cfg['hidden_activation']!r} is not supported (gelu_pytorch_tanh is)")
    # (Gemma 2 turns every layer by one RoPE base; Gemma 3's windowed layers have their own)
    local = None if arch == "Gemma2ForCausalLM" else \
        (local_rope or {}).get("rope_theta", cfg.get("rope_local_base_freq", 10000.0))
    return dict(attention_scale=cfg.get("query_pre_attn_scalar", cfg.get("head_dim", 256)) ** -0.5,
                local_rope_theta=local, norm_offset=1.0,
                attn_logit_softcap=cfg.get("attn_logit_softcapping") or 0.0,
                final_logit_softcap=cfg.get("final_logit_softcapping") or 0.0)


# generation_config.json's sampling settings a request may leave to the model (vLLM's list;
# its max_new_tokens is ModelConfig.max_new_tokens).
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2, 3, 4)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    # A GGUF file's rope_freqs: each rotary pair's frequency is divided by its factor (how
    # llama.cpp's converter stores Llama 3.1's scaling); None: no such tensor.
    rope_freq_factors: tuple[float, ...] | None = None
    # The head's first rows RoPE turns, in halves of their own (Phi-4-mini's 3/4:
    # partial_rotary_factor); 0: the whole head.
    rotary_dim: int = 0
    # Each layer's sliding window (positions a query sees, its own included; 0: the whole
    # context); empty: no layer has one. Mistral v0.1 and Phi-3 window every layer, Qwen2
    # with use_sliding_window those from max_window_layers on, as transformers' layer_types.
    layer_windows: tuple[int, ...] = ()
    # Settings Gemma gives (models/gemma.py): the attention's scale (query_pre_attn_scalar
    # ** -0.5; None: head_dim ** -0.5), the windowed layers' RoPE base (None: the full
    # layers' table, Gemma 2's one base), and what is added to each norm weight at load
    # (Gemma's norms scale by 1 + w: 1 for a checkpoint directory, 0 for a GGUF, whose
    # converter added it).
    attention_scale: float | None = None
    local_rope_theta: float | None = None
    norm_offset: float = 0.0
    # Gemma 2's soft-capping (0: none): attention scores become cap * tanh(score / cap)
    # before the softmax, and so do the LM head's logits, with a cap each.
    attn_logit_softcap: float = 0.0
    final_logit_softcap: float = 0.0
    # Gemma 4's layer options (models/gemma4_config.py); None: another family.
    gemma4: Gemma4Settings | None = None
    # Each layer's (KV heads, head size) where some layer's differ from num_key_value_heads and
    # head_dim (Gemma 4's full layers: global_head_dim 512 beside 256); empty: none differs.
    layer_attention: tuple[tuple[int, int], ...] = ()
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # each head's query and key are RMS-normalised before RoPE (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # The sampling settings generation_config.json recommends (SAMPLING_KEYS it sets):
    # the defaults of requests that leave them out, as vLLM's --generation-config auto.
    sampling_defaults: dict[str, float] = field(default_factory=dict)
    # generation_config.json's max_new_tokens: the longest answer of a request that sets no
    # length (as vLLM's --generation-config auto; None: up to the context).
    max_new_tokens: int | None = None
    # The experts of a mixture-of-experts family (models/moe.py); None: a dense model.
    moe: MoESettings | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if rope_type not in _SUPPORTED_ROPE_TYPES:
                raise ValueError(
                    f"unsupported rope_scaling type {rope_type!r}; supported: "
                    f"{', '.join(_SUPPORTED_ROPE_TYPES)}")
            missing = [k for k in _ROPE_REQUIRED.get(rope_type, ()) if self.rope_scaling.get(k) is None]
            if missing:
                raise ValueError(f"rope_scaling of type {rope_type} lacks {', '.join(missing)}")
            turned = self.rotary_dim or self.head_dim
            for key in ("long_factor", "short_factor"):
                if key in self.rope_scaling and len(self.rope_scaling[key]) != turned // 2:
                    raise ValueError(f"rope_scaling's {key} has {len(self.rope_scaling[key])} values; "
                                     f"the {turned} rotary dimensions need {turned // 2}")
        if self.rotary_dim and (self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim):
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even and at most the head size {self.head_dim}")
        if self.layer_windows and (len(self.layer_windows) != self.num_hidden_layers
                                   or any(w < 0 for w in self.layer_windows)):
            raise ValueError(f"layer_windows must give each of the {self.num_hidden_layers} layers a window "
                             f">= 0, got {self.layer_windows}")
        if self.layer_attention and (len(self.layer_attention) != self.num_hidden_layers or any(
                kv < 1 or self.num_attention_heads % kv or d < 2 or d % 2 for kv, d in self.layer_attention)):
            raise ValueError(f"layer_attention must give each of the {self.num_hidden_layers} layers KV heads "
                             f"dividing {self.num_attention_heads} and an even head size, got {self.layer_attention}")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.full_head_dim // 2:
            raise ValueError(f"rope_freqs has {len(self.rope_freq_factors)} factors; the head size "
                             f"{self.full_head_dim} needs {self.full_head_dim // 2}")

    def layer_window(self, index: int) -> int:
        """Layer ``index``'s sliding window (0: none)."""
        return self.layer_windows[index] if self.layer_windows else 0

    def layer_kv_heads(self, index: int) -> int:
        """Layer ``index``'s KV heads (its cache's)."""
        return self.layer_attention[index][0] if self.layer_attention else self.num_key_value_heads

    def layer_head_dim(self, index: int) -> int:
        """Layer ``index``'s head size (its queries', keys' and values')."""
        return self.layer_attention[index][1] if self.layer_attention else self.head_dim

    @property
    def full_head_dim(self) -> int:
        """The head size of the full-attention layers (the model's RoPE table's; Gemma 4's
        global_head_dim), head_dim when no layer's differs."""
        full = [i for i in range(self.num_hidden_layers) if not self.layer_window(i)]
        return self.layer_head_dim(full[0]) if self.layer_attention and full else self.head_dim

    @property
    def kv_sources(self) -> tuple[int, ...]:
        """The layer whose KV cache each layer reads: itself, but in Gemma 4's KV-sharing
        last layers; empty when every layer reads its own."""
        return self.gemma4.kv_source if self.gemma4 is not None and self.gemma4.kv_source != tuple(
            range(self.num_hidden_layers)) else ()

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], generation_config: dict[str, Any] | None = None) -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dict (and ``generation_config.json``)."""
        archs = cfg.get("architectures") or []
        if len(archs) != 1:
            raise ValueError(f"config.json must name exactly one architecture, got {archs!r}")
        arch = _BASE_MODELS.get(archs[0], archs[0])
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        gemma4 = None
        if arch == GEMMA4_ARCHITECTURE:  # (read as Gemma 3's config, then its own settings over it)
            cfg, gemma4 = gemma4_text_config(cfg)
        windows = _layer_windows(cfg, arch)
        hidden = cfg["hidden_size"]
        heads = cfg["num_attention_heads"]
        # transformers >= 5 writes rope settings as one `rope_parameters` dict.
        rope = dict(cfg.get("rope_parameters") or {})
        local_rope = None
        if "full_attention" in rope:  # one set per layer type (Gemma 3)
            local_rope = rope.get("sliding_attention") or {}
            rope = dict(rope["full_attention"] or {})
        rope_theta = cfg.get("rope_theta", rope.pop("rope_theta", 10000.0))
        partial = cfg.get("partial_rotary_factor", rope.pop("partial_rotary_factor", 1.0))
        head_dim = cfg.get("head_dim") or hidden // heads
        rotary_dim = int(head_dim * partial) if partial != 1.0 else 0  # (Phi-4-mini's 0.75)
        rope_scaling = cfg.get("rope_scaling")
        if rope_scaling is None and rope.get("rope_type", "default") != "default":
            rope_scaling = rope
        if rope_scaling is not None and rope_scaling.get("original_max_position_embeddings") is None \
                and cfg.get("original_max_position_embeddings") is not None:
            # (Phi-3 keeps it beside rope_scaling; transformers moves it in)
            rope_scaling = {**rope_scaling, "original_max_position_embeddings": cfg["original_max_position_embeddings"]}
        sampling = {k: v for k, v in (generation_config or {}).items()
                    if k in SAMPLING_KEYS and isinstance(v, (int, float)) and not isinstance(v, bool)}
        longest = (generation_config or {}).get("max_new_tokens")
        if not isinstance(longest, int) or isinstance(longest, bool) or longest < 1:
            longest = None
        eos = (generation_config or {}).get("eos_token_id", cfg.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        config = cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=cfg.get("tie_word_embeddings", arch in GEMMA_ARCHITECTURES),
            attention_bias=cfg.get("attention_bias", arch == "Qwen2ForCausalLM"),
            qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sampling_defaults=sampling,
            max_new_tokens=longest,
            layer_windows=windows,
            **(_gemma_settings(cfg, arch, local_rope) if arch in GEMMA_ARCHITECTURES else {}),
        )
        if gemma4 is not None:
            return replace(config, **gemma4)
        return replace(config, **moe_fields(cfg, arch, config.head_dim)) if arch in MOE_ARCHITECTURES else config

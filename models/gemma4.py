"""Gemma 4 (text): Gemma 3's decoder (models/gemma.py) with Gemma 4's differences.

What Gemma 4 changes (``ModelConfig`` and its ``gemma4`` settings carry each; read by
``models.gemma4_config``, which also names what is refused):

* norms scale by ``w``, not ``1 + w``; the attention is not scaled (the per-head query
  and key norms set the scores' size);
* values are RMS-normalised per head (no weight) before the cache;
* the full-attention layers turn only the first part of each head (proportional RoPE: the
  other pairs' frequencies are 0, ``ModelConfig.rope_freq_factors``), the windowed ones
  the whole head by their own base;
* per-layer input embeddings: a second table gives each token a small vector per layer,
  mixed with a projection of its embedding; each layer adds a gated projection of its own;
* the last ``num_kv_shared_layers`` layers have no K/V projection: they attend to the
  cached keys and values of the last earlier layer of their type (and may have an MLP
  twice as wide); with ``attention_k_eq_v`` the full layers' values are their key
  projection (loaded into the value rows);
* each layer's output is scaled by its ``layer_scalar``; the logits may be soft-capped;
* the 26B-A4B adds experts beside every layer's MLP (``Gemma4Router``: a softmax over all
  experts, the k largest renormalised and scaled per expert; the experts' GELU-tanh MLPs
  run on their tokens through ``models.experts``, outputs added in ascending expert id);
* the full layers have a head size (``global_head_dim``) and may have a KV head count of
  their own (``ModelConfig.layer_attention``): their caches take their own row shape
  (``models.kv_cache.allocate``).

Its layers run op by op, on Llama's GEMMs and paged-attention kernels; not with LoRA
adapters or tensor parallel.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from models import ops
from models.attention import AttentionMetadata, paged_attention
from models.config import ModelConfig
from models.dense import DTYPES, PackedLinear
from models.experts import FusedExperts, mix_experts
from models.gemma import GemmaDecoderLayer, GemmaForCausalLM, GemmaMLP
from models.llama import Attention, RMSNorm
from models.moe import convert_projection
from models.moe_config import MoESettings
from models.quant import prepare_decoder_projections
from models.rope import RotaryEmbedding, interleave_rotary_rows

KV = tuple[torch.Tensor, torch.Tensor]
# The per-layer input projections, beside the decoder's (``prepare_projections``).
_PER_LAYER_LINEARS = ("per_layer_model_projection", "per_layer_input_gate", "per_layer_projection")


class Gemma4Attention(Attention):
    """Llama's attention with normed values; a K/V-sharing layer projects queries only."""

    def __init__(self, config: ModelConfig, index: int) -> None:
        # (its own head size and KV heads: the full layers' global_head_dim)
        super().__init__(replace(config, head_dim=config.layer_head_dim(index),
                                 num_key_value_heads=config.layer_kv_heads(index)), config.layer_window(index))
        assert config.gemma4 is not None
        self.shares_kv = config.gemma4.shares_kv(index)
        if self.shares_kv:
            self.qkv_proj = nn.Linear(config.hidden_size, self.q_size, bias=False)
            self.k_norm = None
        self.eps = config.rms_norm_eps

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: KV, source: KV | None = None) -> tuple[torch.Tensor, KV]:
        """``(out, (k, v))``: this step's rotated keys and values, which a K/V-sharing layer
        takes from its source layer (``source``), as it reads that layer's ``kv_cache``."""
        assert self.q_norm is not None
        t, d, q_size, kv_size = x.shape[0], self.head_dim, self.q_size, self.kv_size
        qkv = self.qkv_proj(x)
        q = self.q_norm(qkv[:, :q_size].reshape(-1, d)).reshape(t, q_size)
        if self.shares_kv:
            assert source is not None, "a K/V-sharing layer runs after its source layer"
            k, v = source
            q = ops.apply_rotary(q.view(t, self.num_heads, d), rope.rotations[positions].unsqueeze(1))
        else:
            assert self.k_norm is not None
            k = self.k_norm(qkv[:, q_size:q_size + kv_size].reshape(-1, d)).reshape(t, kv_size)
            v = qkv[:, q_size + kv_size:].reshape(-1, d).float()
            # (Gemma 4's unweighted value norm, in float32 as transformers computes it)
            v = (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype).reshape(t, kv_size)
            q, k, v = ops.rotary_and_cache(torch.cat([q, k, v], dim=1), rope.rotations, positions, *kv_cache,
                                           meta.slot_mapping, self.num_heads, self.num_kv_heads)
        o = paged_attention(q, k, v, *kv_cache, meta, self.scale, self.window, self.softcap)
        return self.o_proj(o.reshape(t, q_size)), (k, v)


def _unweighted_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalised rows of ``x`` in float32, no weight (transformers' Gemma 4 arithmetic)."""
    x = x.float()
    return x * torch.pow(x.pow(2).mean(-1, keepdim=True) + eps, -0.5)


class Gemma4Router(nn.Module):
    """The 26B-A4B's router: the layer's input normalised (no weight), scaled by ``scale``
    and hidden_size ** -0.5, projected to one logit per expert; a softmax in float32, the
    k largest renormalised to sum to 1, each then times its expert's ``per_expert_scale``."""

    def __init__(self, config: ModelConfig, moe: MoESettings) -> None:
        super().__init__()
        self.moe, self.eps, self.root = moe, config.rms_norm_eps, config.hidden_size ** -0.5
        self.proj = nn.Linear(config.hidden_size, moe.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(config.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(moe.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, k] float32, experts [T, k])``."""
        h = (_unweighted_norm(x, self.eps).to(x.dtype) * self.scale * self.root)
        probs = torch.softmax(self.proj(h).float(), dim=-1)
        weights, chosen = probs.topk(self.moe.experts_per_token, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale.float()[chosen], chosen


class Gemma4DecoderLayer(GemmaDecoderLayer):
    """Gemma's layer, then its per-layer input's gated projection, all scaled by ``layer_scalar``.
    With experts (the 26B-A4B), the MLP's output and the experts' (on the layer's input,
    normed apart) are each normed and added before the post-MLP norm."""

    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__(config, index)
        settings = config.gemma4
        assert settings is not None
        self.self_attn = Gemma4Attention(config, index)
        if settings.mlp_sizes[index] != config.intermediate_size:
            self.mlp = GemmaMLP(replace(config, intermediate_size=settings.mlp_sizes[index]))
        size = settings.per_layer_size
        if size:
            self.per_layer_input_gate = nn.Linear(config.hidden_size, size, bias=False)
            self.per_layer_projection = nn.Linear(size, config.hidden_size, bias=False)
            self.post_per_layer_input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layer_scalar = nn.Parameter(torch.ones(1))
        self.router: Gemma4Router | None = None
        self.fused: FusedExperts | None = None  # (Gemma4ForCausalLM.fuse_experts)
        moe = settings.experts
        if moe is not None:
            self.router = Gemma4Router(config, moe)
            expert = replace(config, intermediate_size=moe.expert_size)
            self.experts = nn.ModuleList(GemmaMLP(expert) for _ in range(moe.num_experts))
            for name in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2", "pre_feedforward_layernorm_2"):
                setattr(self, name, RMSNorm(config.hidden_size, config.rms_norm_eps))

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, positions: torch.Tensor,  # type: ignore[override]
                meta: AttentionMetadata, kv_cache: KV, per_layer_input: torch.Tensor | None,
                source: KV | None) -> tuple[torch.Tensor, KV]:
        h, kv = self.self_attn(self.input_layernorm(x), rope, positions, meta, kv_cache, source)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.router is not None:
            weights, chosen = self.router(x)
            routed, _ = mix_experts(self.experts, self.pre_feedforward_layernorm_2(x), weights, chosen, self.fused)
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(routed)
        x = x + self.post_feedforward_layernorm(h)
        if per_layer_input is not None:
            gate = F.gelu(self.per_layer_input_gate(x), approximate="tanh") * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return x * self.layer_scalar, kv


class Gemma4ForCausalLM(GemmaForCausalLM):
    """Gemma 4's text decoder on Gemma's modules, with its own loader (``load_weights``)."""

    runs_lora = False  # (its layers' head sizes differ, and K/V-sharing layers have no k/v)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        settings = config.gemma4
        if settings is None:
            raise ValueError("Gemma4ForCausalLM needs ModelConfig.gemma4 (ModelConfig.from_hf reads it)")
        self.settings = settings
        self.model.layers = nn.ModuleList(Gemma4DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        if settings.per_layer_size:
            width = config.num_hidden_layers * settings.per_layer_size
            self.model.embed_tokens_per_layer = nn.Embedding(
                settings.per_layer_vocab_size, width, _weight=torch.empty(settings.per_layer_vocab_size, width))
            self.model.per_layer_model_projection = nn.Linear(config.hidden_size, width, bias=False)
            self.model.per_layer_projection_norm = RMSNorm(settings.per_layer_size, config.rms_norm_eps)

    def init_rope(self, max_positions: int) -> None:
        """The full layers' table at their head size (global_head_dim), the windowed layers'
        at theirs, by their own base."""
        cfg, device = self.config, self.model.norm.weight.device
        self.rope = RotaryEmbedding(replace(cfg, head_dim=cfg.full_head_dim), max_positions, device)
        self.local_rope = RotaryEmbedding(replace(cfg, rope_theta=cfg.local_rope_theta, rope_scaling=None,
                                                  rope_freq_factors=None), max_positions, device)

    def _per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Each token's input to each layer ``[T, layers, size]``: its row of the per-layer
        table (times sqrt(size)) and the normed projection of its embedding ``x`` (times
        hidden_size ** -0.5), averaged by 2 ** -0.5 as transformers does."""
        size, layers = self.settings.per_layer_size, self.config.num_hidden_layers
        t = x.shape[0]
        rows = self.model.embed_tokens_per_layer(input_ids) * torch.tensor(size ** 0.5).to(x.dtype)
        projected = self.model.per_layer_model_projection(x) * self.config.hidden_size ** -0.5
        projected = self.model.per_layer_projection_norm(projected.reshape(-1, size)).reshape(t, layers, size)
        return (projected + rows.reshape(t, layers, size)) * 2.0 ** -0.5

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[KV], logits_indices: torch.Tensor | None = None, lora: object | None = None,
                hidden_indices: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """As ``LlamaForCausalLM.forward`` (no LoRA rows, no tensor parallel). A K/V-sharing
        layer reads its source layer's cache (its own stays unused)."""
        assert self.rope is not None and self.local_rope is not None, "call init_rope() before forward()"
        if lora is not None or self.tp is not None:
            raise ValueError("Gemma 4 runs without LoRA adapters and tensor parallel here")
        sources = self.settings.kv_source
        x = self.model.embed_tokens(input_ids)
        x = x * torch.tensor(self.config.hidden_size ** 0.5).to(x.dtype)
        per_layer = self._per_layer_inputs(input_ids, x) if self.settings.per_layer_size else None
        step_kv: dict[int, KV] = {}
        for i, layer in enumerate(self.model.layers):
            src = sources[i]
            rope = self.local_rope if layer.self_attn.window else self.rope
            x, kv = layer(x, rope, positions, meta.for_layer(src), kv_caches[src],
                          per_layer[:, i] if per_layer is not None else None, step_kv.get(src))
            step_kv.setdefault(i, kv)
        return self.head(x, logits_indices, hidden_indices)

    def prepare_projections(self, quantization: str) -> None:
        """The decoder's projections as ``quantization`` runs them (``quant.prepare_projections``),
        the experts' too (as ``models.moe`` converts them), then ``prepare_extras``."""
        prepare_decoder_projections(self, quantization)
        packable = ops.kernels_enabled(self.model.norm.weight.device) and self.model.norm.weight.dtype in DTYPES
        for layer in self.model.layers:
            for expert in getattr(layer, "experts", ()):
                for name in ("gate_up_proj", "down_proj"):
                    setattr(expert, name, convert_projection(getattr(expert, name), quantization, packable))
        self.prepare_extras()

    def fuse_experts(self) -> None:
        """Each expert layer's experts as ``FusedExperts`` where they can be (a GGUF's codes on
        ``w4a8``): call once their projections are final."""
        for layer in self.model.layers:
            if layer.router is not None:
                layer.fused = FusedExperts.of(layer.experts)

    def prepare_extras(self) -> None:
        """The per-layer input projections in the packed dense GEMM where the kernels run
        (a GGUF's native paths call this after building the decoder's): torch's GEMM gives a
        row another result in another batch, the packed one does not."""
        weight = self.model.norm.weight
        if not (ops.kernels_enabled(weight.device) and weight.dtype in DTYPES):
            return
        routers = [layer.router for layer in self.model.layers if layer.router is not None]
        for module in [self.model, *self.model.layers, *routers]:
            for name in (*_PER_LAYER_LINEARS, "proj"):  # (a router's, which picks the experts)
                child = getattr(module, name, None)
                if isinstance(child, nn.Linear):
                    setattr(module, name, PackedLinear(child))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into the parameters: q/k/v and gate/up into their
        fused rows (of each layer's own sizes), Q/K rows and norms in the interleaved rotary
        order. A K/V-sharing layer's K/V tensors, which transformers ignores too, are skipped.

        Raises ``ValueError`` naming the tensor for an unknown name or a wrong shape, and the
        parameters the checkpoint leaves (partly) unfilled.
        """
        cfg = self.config
        params = dict(self.named_parameters())
        filled = {name: 0 for name in params}
        if cfg.tie_word_embeddings:
            filled.pop("lm_head.weight", None)
        for name, tensor in weights:
            if "rotary_emb" in name or (name == "lm_head.weight" and cfg.tie_word_embeddings):
                continue
            for target, start, rows in self._places(name, tensor):
                param = params.get(target)
                if param is None:
                    raise ValueError(f"checkpoint tensor {name!r} does not belong to {cfg.architecture}")
                dst = param.data if start is None else param.data[start:start + rows.shape[0]]
                if tuple(rows.shape) != tuple(dst.shape):
                    raise ValueError(f"tensor {name!r} has shape {tuple(rows.shape)}, expected {tuple(dst.shape)}")
                dst.copy_(rows)
                filled[target] += dst.shape[0] if dst.dim() else 1
        missing = [n for n, count in filled.items() if count != (params[n].shape[0] if params[n].dim() else 1)]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensor(s) or parts, e.g. {', '.join(missing[:5])}")

    def _places(self, name: str, tensor: torch.Tensor) -> list[tuple[str, int | None, torch.Tensor]]:
        """Where a checkpoint tensor goes: ``(parameter, first row or None for all, rows)``."""
        parts = name.split(".")
        if len(parts) < 5 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
            return [(name, None, tensor)]
        index, module = int(parts[2]), ".".join(parts[3:-1])
        layer = self.model.layers[index]
        attn, prefix = layer.self_attn, f"model.layers.{index}."
        if attn.shares_kv and module in ("self_attn.k_proj", "self_attn.v_proj", "self_attn.k_norm",
                                         "self_attn.v_norm"):
            return []
        qkv, gate_up = prefix + "self_attn.qkv_proj.weight", prefix + "mlp.gate_up_proj.weight"
        q, kv, inter = attn.q_size, attn.kv_size, layer.mlp.intermediate_size
        if module == "self_attn.q_proj":
            return [(qkv, 0, interleave_rotary_rows(tensor, attn.num_heads))]
        if module == "self_attn.k_proj":
            places = [(qkv, q, interleave_rotary_rows(tensor, attn.num_kv_heads))]
            if self.settings.values_from_keys and not attn.window:
                places.append((qkv, q + kv, tensor))  # (the values: the key projection, before its norm and RoPE)
            return places
        if module == "self_attn.v_proj":
            return [(qkv, q + kv, tensor)]
        if module in ("self_attn.q_norm", "self_attn.k_norm"):
            return [(name, None, interleave_rotary_rows(tensor, 1))]
        if module in ("mlp.gate_proj", "mlp.up_proj"):
            return [(gate_up, 0 if module == "mlp.gate_proj" else inter, tensor)]
        if module == "experts" and parts[-1] in ("gate_up_proj", "down_proj"):  # stacked [E, out, in]
            return [(f"{prefix}experts.{e}.{parts[-1]}.weight", None, tensor[e]) for e in range(tensor.shape[0])]
        if module == "experts" and parts[-1] in ("gate_proj", "up_proj"):  # (a GGUF's gate and up apart)
            first = 0 if parts[-1] == "gate_proj" else tensor.shape[1]
            return [(f"{prefix}experts.{e}.gate_up_proj.weight", first, tensor[e]) for e in range(tensor.shape[0])]
        return [(name, None, tensor)]

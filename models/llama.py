"""Llama-family decoder (Llama 2/3, SmolLM2, TinyLlama, Mistral, Qwen2) over a paged KV cache.

Parameter names follow Hugging Face checkpoints, except that q/k/v and
gate/up projections are stored fused (``qkv_proj``, ``gate_up_proj``) so each
layer runs two matmuls fewer; ``load_weights`` maps checkpoint names onto them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from models.attention import AttentionMetadata, paged_attention, write_kv
from models.config import ModelConfig
from models.rope import RotaryEmbedding, apply_rotary, interleave_rotary_rows


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return nn.functional.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Variance in float32 for low-precision activations, as the reference does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor,
                meta: AttentionMetadata, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        # Q and K heads are adjacent in the fused output: rotate them in one call.
        qk = apply_rotary(qkv[:, :self.q_size + self.kv_size].view(t, -1, self.head_dim), rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, rope, meta, kv_cache):
        x = x + self.self_attn(self.input_layernorm(x), rope, meta, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


# Checkpoint projection name -> (fused parameter, shard index).
_FUSED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    """Decoder-only LM; ``forward`` runs one flat batch and returns logits for chosen rows."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope: RotaryEmbedding | None = None

    def init_rope(self, max_positions: int) -> None:
        """Build the cos/sin tables on the model's device and dtype (after weights are loaded)."""
        self.rope = RotaryEmbedding(self.config, max_positions, self.model.embed_tokens.weight.device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """Run ``input_ids [T]`` at ``positions [T]``; return float32 logits ``[len(logits_indices), V]``.

        ``logits_indices`` picks the rows to project through the LM head (all rows if None):
        the head is the largest matmul, so only sampled positions pay for it.
        """
        assert self.rope is not None, "call init_rope() before forward()"
        x = self.model.embed_tokens(input_ids)
        rope = self.rope.lookup(positions)
        for layer, kv in zip(self.model.layers, kv_caches):
            x = layer(x, rope, meta, kv)
        if logits_indices is not None:
            x = x.index_select(0, logits_indices)
        return self.lm_head(self.model.norm(x)).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into the parameters, checking names and shapes.

        Raises ``ValueError`` naming the tensor for an unknown name, a wrong shape
        or a parameter the checkpoint does not provide.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        cfg = self.config
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            target, shard = name, None
            for ckpt, (fused, idx) in _FUSED.items():
                if f".{ckpt}." in name:
                    target, shard = name.replace(ckpt, fused), idx
                    break
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} does not belong to {cfg.architecture}")
            dst = param.data
            if shard in (0, 1) and target.endswith(("qkv_proj.weight", "qkv_proj.bias")):
                heads = cfg.num_attention_heads if shard == 0 else cfg.num_key_value_heads
                tensor = interleave_rotary_rows(tensor, heads)
            if shard is not None:
                dst = _shard(dst, target, shard, cfg)
            if tuple(tensor.shape) != tuple(dst.shape):
                raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded.add(name if shard is None else f"{target}#{shard}")
        expected = set()
        for pname in params:
            if pname.endswith("qkv_proj.weight") or pname.endswith("qkv_proj.bias"):
                expected.update(f"{pname}#{i}" for i in range(3))
            elif pname.endswith("gate_up_proj.weight"):
                expected.update(f"{pname}#{i}" for i in range(2))
            else:
                expected.add(pname)
        if cfg.tie_word_embeddings:
            expected.discard("lm_head.weight")
        missing = sorted(expected - loaded)
        if missing:
            shown = ", ".join(_checkpoint_name(m) for m in missing[:5])
            raise ValueError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {shown}")


def _checkpoint_name(key: str) -> str:
    """``...gate_up_proj.weight#1`` -> ``...up_proj.weight``: the name the checkpoint lacks."""
    name, _, idx = key.partition("#")
    for ckpt, (fused, i) in _FUSED.items():
        if idx and f".{fused}." in name and int(idx) == i:
            return name.replace(f".{fused}.", f".{ckpt}.")
    return name


def _shard(fused: torch.Tensor, name: str, idx: int, cfg: ModelConfig) -> torch.Tensor:
    """The rows of a fused parameter that one checkpoint projection fills."""
    if "qkv_proj" in name:
        q = cfg.num_attention_heads * cfg.head_dim
        kv = cfg.num_key_value_heads * cfg.head_dim
        sizes = [q, kv, kv]
    else:
        sizes = [cfg.intermediate_size] * 2
    start = sum(sizes[:idx])
    return fused[start:start + sizes[idx]]

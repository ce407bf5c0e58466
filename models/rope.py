"""Rotary position embeddings, with Llama 3 and linear scaling.

kvserve stores each head's Q/K features with the rotary pairs interleaved
(``x0, x1`` rotate together, then ``x2, x3``, ...), the layout llama.cpp
uses, instead of Hugging Face's split halves. Attention scores are unchanged
by a permutation applied to both Q and K, and with pairs adjacent the rotation
is a single complex multiplication (or one pass of the fused kernel in
``models.ops``) instead of a dozen small ops per layer.
``LlamaForCausalLM.load_weights`` permutes checkpoint Q/K rows into this layout.
"""

from __future__ import annotations

import math

import torch

from models.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """``1 / theta^(2i/d)`` for the rotary pairs, scaled as the checkpoint asks."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).double() / dim))
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, scaling)
    return inv_freq.float()


def _llama3_scale(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and
    # the band between is interpolated smoothly.
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def interleave_rotary_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Reorder Q or K projection rows (or bias) from HF's split halves to interleaved pairs."""
    rows = w.shape[0]
    half = rows // num_heads // 2
    return w.reshape(num_heads, 2, half, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class RotaryEmbedding:
    """Precomputed unit complex rotations for every position up to ``max_positions``."""

    def __init__(self, config: ModelConfig, max_positions: int, device: torch.device) -> None:
        inv_freq = inverse_frequencies(config).to(device)
        t = torch.arange(max_positions, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [P, head_dim / 2]
        self.rotations = torch.polar(torch.ones_like(freqs), freqs)  # complex64

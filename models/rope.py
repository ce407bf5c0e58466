"""Rotary position embeddings, with the scalings of long-context checkpoints.

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


def rope_parameters(config: ModelConfig, max_positions: int) -> tuple[torch.Tensor, float]:
    """The rotary pairs' inverse frequencies (``1 / theta^(2i/d)``, scaled as the
    checkpoint asks) and the attention factor that multiplies the cos/sin tables (YaRN's
    and LongRoPE's; 1 otherwise), for a server holding ``max_positions`` positions.

    Types as transformers defines them (``default``, ``linear``, ``llama3``, ``yarn``,
    ``longrope``, ``dynamic``), and a GGUF file's ``rope_freqs`` factors
    (``config.rope_freq_factors``: each pair's frequency divided by its factor, as
    llama.cpp applies Llama 3.1's). transformers switches LongRoPE's factors, and
    recomputes dynamic NTK's base, by the length of the sequence in each forward; here
    both follow the served context (``max_positions``), as llama.cpp's follow its
    ``n_ctx``, so that a token's rotation never depends on how long its sequence has
    grown: equal to transformers for LongRoPE on sequences on the same side of
    ``original_max_position_embeddings`` as the served context, and for dynamic NTK while
    the served context is within ``max_position_embeddings``.
    """
    dim = config.rotary_dim or config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).double() / dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    attention_factor = 1.0
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, scaling)
    elif rope_type == "yarn":
        inv_freq, attention_factor = _yarn(config, scaling)
    elif rope_type == "longrope":
        original = scaling["original_max_position_embeddings"]
        factors = scaling["long_factor" if max_positions > original else "short_factor"]
        inv_freq = 1.0 / (torch.tensor(factors, dtype=torch.float32) * config.rope_theta ** exponents.float())
        factor = scaling.get("factor") or config.max_position_embeddings / original
        attention_factor = scaling.get("attention_factor") or (
            math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0)
    elif rope_type == "dynamic":
        longest = max(max_positions, config.max_position_embeddings)
        factor = scaling["factor"]
        base = config.rope_theta * ((factor * longest / config.max_position_embeddings) - (factor - 1)) ** (
            dim / (dim - 2))
        inv_freq = 1.0 / (base ** exponents.float())
    # (a partial rotary's unturned pairs: frequency 0, a rotation by nothing)
    inv_freq = torch.cat([inv_freq, inv_freq.new_zeros((config.head_dim - dim) // 2)])
    if config.rope_freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float64)
    return inv_freq.float(), float(attention_factor)


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


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(config: ModelConfig, s: dict) -> tuple[torch.Tensor, float]:
    # YaRN (Peng et al.): the pairs that turn fewer than beta_slow times over the original
    # context are interpolated by `factor`, those that turn more than beta_fast times kept,
    # a linear ramp between; the tables are scaled by the attention factor (mscale).
    # Computed in float32, as transformers' _compute_yarn_parameters is.
    dim, base = config.rotary_dim or config.head_dim, config.rope_theta
    original = s.get("original_max_position_embeddings") or config.max_position_embeddings
    factor = s.get("factor") or config.max_position_embeddings / original
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
        attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else _yarn_mscale(factor))
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (no ramp of width 0)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation
    return inv_freq, attention_factor


def interleave_rotary_rows(w: torch.Tensor, num_heads: int, rotary_dim: int = 0) -> torch.Tensor:
    """Reorder Q or K projection rows (or bias) from HF's split halves to interleaved pairs.
    ``rotary_dim`` (0: the whole head): only each head's first ``rotary_dim`` rows turn, in
    halves of their own (Phi-4-mini's ``partial_rotary_factor``); the others stay in place."""
    head = w.shape[0] // num_heads
    r = rotary_dim or head
    heads = w.reshape(num_heads, head, *w.shape[1:])
    turned = heads[:, :r].reshape(num_heads, 2, r // 2, *w.shape[1:]).transpose(1, 2).reshape(
        num_heads, r, *w.shape[1:])
    return torch.cat([turned, heads[:, r:]], dim=1).reshape(w.shape)


class RotaryEmbedding:
    """Precomputed complex rotations for every position up to ``max_positions``: unit
    ones, or of the attention factor's length (YaRN, LongRoPE), which scales queries and
    keys as transformers' cos/sin tables do (a partial rotary's unturned pairs: 1, as
    transformers passes them through)."""

    def __init__(self, config: ModelConfig, max_positions: int, device: torch.device) -> None:
        inv_freq, attention_factor = rope_parameters(config, max_positions)
        t = torch.arange(max_positions, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.to(device))  # [P, head_dim / 2]
        length = torch.full_like(freqs, attention_factor)
        length[:, (config.rotary_dim or config.head_dim) // 2:] = 1.0
        self.rotations = torch.polar(length, freqs)  # complex64

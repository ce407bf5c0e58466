"""The row-wise ops (``csrc/rowwise.cpp``, ``csrc/argmax.cpp``): residual add and
RMSNorm, SiLU * up, RoPE with the KV-cache write, the argmax of each row and a
grammar's token bitmask. Each runs its kernel where ``kernels_for`` gives one and the
tensor's layout fits, else its plain-torch twin.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models import kv_cache
from models.ops.build import kernels_for


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim of ``x [T, H]``."""
    ext = kernels_for(x)
    if ext is not None and x.dim() == 2 and x.stride(1) == 1:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        ext.rms_norm(out, x, weight, eps)
        return out
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    # Variance in float32 for low-precision activations, as the reference does.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual + x`` and its RMSNorm: returns ``(normed, new_residual)``.

    The kernel updates ``residual`` in place, so the caller must own it.
    """
    ext = kernels_for(x)
    if ext is not None and x.dim() == 2 and x.stride(1) == 1 and residual.is_contiguous():
        out = torch.empty_like(residual)
        ext.add_rms_norm(out, residual, x, weight, eps)
        return out, residual
    residual = residual + x
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where ``gate_up [T, 2I]`` holds gate then up."""
    half = gate_up.shape[-1] // 2
    ext = kernels_for(gate_up)
    if ext is not None and gate_up.dim() == 2 and gate_up.stride(1) == 1:
        out = gate_up.new_empty(gate_up.shape[0], half)
        ext.silu_and_mul(out, gate_up)
        return out
    gate, up = gate_up.split(half, dim=-1)
    return F.silu(gate) * up


def rotary_and_cache(qkv: torch.Tensor, rotations: torch.Tensor, positions: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                     num_heads: int, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotate the Q and K heads of ``qkv [T, (H + 2 KVH) D]`` and store K and V in their slots.

    ``rotations [P, D/2]`` (complex64) is the whole table, looked up at
    ``positions``. Returns ``q [T, H, D]``, ``k``, ``v [T, KVH, D]`` (rotated).
    """
    t = qkv.shape[0]
    head_dim = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    ext = kernels_for(qkv)
    fused = (ext is not None and qkv.stride(1) == 1 and kv_cache.paged_layout(k_cache)
             and kv_cache.paged_layout(v_cache))
    if fused:
        ext.rotary_and_cache(qkv, torch.view_as_real(rotations), positions, k_cache, v_cache,
                             slot_mapping, num_heads, num_kv_heads)
        qk = qkv[:, :q_size + kv_size].view(t, -1, head_dim)
    else:
        # Q and K heads are adjacent in the fused output: rotate them in one call.
        qk = apply_rotary(qkv[:, :q_size + kv_size].view(t, -1, head_dim), rotations[positions].unsqueeze(1))
    q, k = qk.split([num_heads, num_kv_heads], dim=1)
    v = qkv[:, q_size + kv_size:].view(t, num_kv_heads, head_dim)
    if not fused:
        write_kv(k_cache, v_cache, k, v, slot_mapping)
    return q, k, v


def apply_rotary(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, H, D]`` (interleaved pairs, any float dtype) by ``rotations [T, 1, D/2]``."""
    t, h, d = x.shape
    xc = torch.view_as_complex(x.float().reshape(t, h, d // 2, 2))
    return torch.view_as_real(xc * rotations).reshape(t, h, d).to(x.dtype)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter new keys/values ``[T, kv_heads, head_dim]`` into their slots (in the caches' format).
    A cache's blocks may lie further apart than its rows fill (``kv_cache.allocate``)."""
    block_size = k_cache.shape[1]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    for cache, x in ((k_cache, k), (v_cache, v)):
        cache.index_put_((blocks, offsets), kv_cache.to_cache_rows(x, cache.dtype))


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for ``x [S, V]``: int64 ``[S]``, the first index on ties, NaN counting as largest."""
    ext = kernels_for(x)
    if ext is not None and x.dim() == 2 and x.dtype == torch.float32 and x.stride(1) == 1 and x.shape[1] > 0:
        out = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
        ext.argmax_rows(out, x)
        return out
    return x.argmax(dim=-1)


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], masks: torch.Tensor) -> None:
    """Set ``logits[rows[i], t] = -inf`` (in place) wherever bit ``t % 32`` of ``masks[i, t // 32]`` is 0.

    ``logits [S, V]`` float32; ``masks [len(rows), >= ceil(V/32)]`` int32 (a grammar's allowed tokens).
    """
    if not rows:
        return
    ext = kernels_for(logits)
    if ext is not None and logits.dtype == torch.float32 and logits.stride(1) == 1:
        ext.apply_token_bitmask(logits, torch.tensor(rows, dtype=torch.long), masks.contiguous())
        return
    vocab = logits.shape[1]
    bits = torch.arange(32, dtype=torch.int32, device=masks.device)
    allowed = ((masks.unsqueeze(-1) >> bits) & 1).view(len(rows), -1)[:, :vocab].bool()
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed.to(logits.device), float("-inf"))

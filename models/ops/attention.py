"""Paged attention over the KV cache (``csrc/paged_attention.cpp``): a decode's one
query per sequence, and prompt chunks read in place, with the same arithmetic for both;
each with its plain-torch twin. ``window`` > 0 is a sliding window: a query at position
p sees the keys at positions p - window + 1 .. p (transformers' sliding attention).
``softcap`` > 0 soft-caps the scores, ``softcap * tanh(score / softcap)``, before the
softmax (Gemma 2's ``attn_logit_softcapping``); 0: none. ``sinks`` (float32, one per
query head; None: none) are gpt-oss's attention sinks: a logit each query's softmax counts
beside its scores, with no value, so that a head may attend to nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models import kv_cache
from models.ops.build import kernels_for


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, max_ctx: int,
                     scale: float, window: int = 0, softcap: float = 0.0,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence ``q [B, H, D]`` over its paged context; returns ``[B, H, D]``.

    The caches may hold another dtype than ``q`` (a float16 or int8 cache for float32
    activations; see ``models.kv_cache``).
    """
    ext = kernels_for(q)
    if (ext is not None and q.stride(2) == 1 and q.stride(1) == q.shape[2]
            and kv_cache.paged_layout(k_cache) and kv_cache.paged_layout(v_cache)):
        out = q.new_empty(q.shape)
        ext.paged_decode_attention(out, q, k_cache, v_cache, block_tables.contiguous(),
                                   context_lens.contiguous(), scale, window, softcap, sinks)
        return out
    return _decode_attention_torch(q, k_cache, v_cache, block_tables, context_lens, max_ctx, scale, window, softcap,
                                   sinks)


def _decode_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, context_lens: torch.Tensor, max_ctx: int,
                            scale: float, window: int = 0, softcap: float = 0.0,
                            sinks: torch.Tensor | None = None) -> torch.Tensor:
    b, heads, head_dim = q.shape
    block_size = k_cache.shape[1]
    nblocks = kv_cache.cdiv(max_ctx, block_size)
    tables = block_tables[:, :nblocks]
    # [B, L, kv_heads, head_dim] -> [B, kv_heads, L, head_dim]
    # index_select on the flat table is markedly faster than advanced indexing on CPU.
    flat = tables.reshape(-1)
    k, v = (kv_cache.from_cache_rows(c.index_select(0, flat), q.dtype).view(b, -1, c.shape[2], head_dim)
            .transpose(1, 2) for c in (k_cache, v_cache))
    places = torch.arange(k.shape[2], device=q.device)
    valid = places < context_lens.unsqueeze(1)  # [B, L]
    if window:
        valid &= places >= context_lens.unsqueeze(1) - window
    # One query per sequence: the heads sharing a KV head act as that head's
    # queries, so GQA needs no repeated K/V: [B, kv_heads, group, head_dim].
    qg = q.reshape(b, k.shape[1], heads // k.shape[1], head_dim)
    group_sinks = None if sinks is None else sinks.view(k.shape[1], -1, 1)  # (a query per grouped head)
    o = _attention(qg, k, v, valid[:, None, None, :], scale, softcap, group_sinks)
    return o.reshape(b, heads, head_dim)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, block_tables: torch.Tensor, query_lens: list[int],
                      context_lens: list[int], scale: float, window: int = 0,
                      softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention for sequences of one or more query tokens each; returns ``[T, H, D]``.

    ``q [T, H, D]`` holds the sequences' tokens one sequence after another;
    sequence i's ``query_lens[i]`` tokens are the last of its ``context_lens[i]``
    positions, whose keys and values are already in the paged caches (``k``,
    ``v [T, KVH, D]`` are this step's, which the torch path uses for fresh prompts).
    """
    ext = kernels_for(q)
    if (ext is not None and q.stride(2) == 1 and q.stride(1) == q.shape[2]
            and kv_cache.paged_layout(k_cache) and kv_cache.paged_layout(v_cache)):
        out = q.new_empty(q.shape)
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        ext.paged_prefill_attention(out, q, k_cache, v_cache, block_tables.contiguous(),
                                    torch.tensor(context_lens, dtype=torch.long),
                                    torch.tensor(starts, dtype=torch.long), scale, window, softcap, sinks)
        return out
    return _prefill_attention_torch(q, k, v, k_cache, v_cache, block_tables, query_lens, context_lens, scale,
                                    window, softcap, sinks)


def _prefill_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, block_tables: torch.Tensor, query_lens: list[int],
                             context_lens: list[int], scale: float, window: int = 0,
                             softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    out = q.new_empty(q.shape)
    start = 0
    for i, (qlen, ctx) in enumerate(zip(query_lens, context_lens)):
        end = start + qlen
        if ctx == qlen:
            # A fresh prompt: its keys are exactly this step's, no gather needed.
            ks, vs = k[start:end], v[start:end]
        else:
            ks = kv_cache.from_cache_rows(_gather(k_cache, block_tables[i], ctx), q.dtype)
            vs = kv_cache.from_cache_rows(_gather(v_cache, block_tables[i], ctx), q.dtype)
        out[start:end] = _causal_attention(q[start:end], ks, vs, scale, window, softcap, sinks)
        start = end
    return out


def _gather(cache: torch.Tensor, block_table: torch.Tensor, ctx: int) -> torch.Tensor:
    """The first ``ctx`` tokens of one sequence, ``[ctx, kv_heads, head_dim]``."""
    block_size = cache.shape[1]
    nblocks = kv_cache.cdiv(ctx, block_size)
    return cache.index_select(0, block_table[:nblocks]).flatten(0, 1)[:ctx]


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
               softcap: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA with a boolean ``mask`` (True: attend); with ``softcap`` or ``sinks`` (a sink logit
    per score row, shaped to broadcast to the scores' ``[..., 1]``), written out, as SDPA has
    no hook between the scores and the softmax."""
    if not softcap and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = q @ k.transpose(-1, -2) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return scores.softmax(-1) @ v
    sink = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1] @ v


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      window: int = 0, softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Queries are the last ``len(q)`` positions of a context of ``len(k)`` tokens."""
    qlen, ctx = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    if group > 1:
        # NOTE: SDPA's enable_gqa falls back to the slow math kernel on CPU;
        # repeating K/V heads keeps the fused (flash) kernel, about 3x faster.
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, heads, len, head_dim]
    if qlen == ctx and not window and not softcap and sinks is None:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    else:
        # Query i sits at position ctx - qlen + i and sees keys 0..that position
        # (with a window, its last `window` of them).
        rows = torch.arange(qlen, device=q.device).unsqueeze(1) + (ctx - qlen)
        keys = torch.arange(ctx, device=q.device).unsqueeze(0)
        mask = keys <= rows
        if window:
            mask &= keys > rows - window
        o = _attention(qh, kh, vh, mask, scale, softcap, None if sinks is None else sinks.view(-1, 1, 1))
    return o[0].transpose(0, 1)

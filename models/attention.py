"""Paged attention over a flat batch of tokens.

The batch holds decode sequences first (one token each) and then prefill
sequences (a prompt, or a chunk of one, possibly after a cached prefix). Each
part is one call (``ops.decode_attention``, ``ops.prefill_attention``): the
fused CPU kernels read the pages in place; their torch twins gather and run SDPA.
Every layer first scatters the batch's new K/V into the paged caches and only
then reads them, so a sequence may attend to blocks that another sequence of
the same batch wrote in the same step (prefix-cache hits on siblings).

Cache layout, per layer: ``[num_blocks, block_size, num_kv_heads, row]`` (stored
head-major within a block: ``models.kv_cache``), in the activations' dtype or a narrower one (``--kv-cache-dtype float16`` or
``int8``; ``models.kv_cache`` has the row formats).
A token at position ``p`` of a sequence lives in slot
``block_table[p // block_size] * block_size + p % block_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.ops import decode_attention, prefill_attention


@dataclass
class SeqSpec:
    """One sequence of a batch, as the runner describes it to the builder."""

    query_len: int  # tokens run this step
    context_len: int  # tokens in the cache after this step (cached prefix + query)
    block_table: list[int]


@dataclass
class AttentionMetadata:
    """Where each token's K/V goes and what each sequence attends to.

    ``num_decodes`` sequences come first, one token each; prefill sequences
    follow. All tensors live on the model's device.
    """

    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B + 1] int64, cumulative query lengths
    context_lens: torch.Tensor  # [B] int64
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0
    num_decodes: int
    # Host copies for the per-prefill loop (avoids device syncs).
    query_lens_host: list[int]
    context_lens_host: list[int]
    # A hybrid cache (``models.kv_cache.KVLayout``): each layer's metadata, its group's
    # block tables and slots (None: every layer reads this one).
    by_layer: list[AttentionMetadata] | None = None

    def for_layer(self, index: int) -> AttentionMetadata:
        """The metadata layer ``index`` reads and writes its cache with."""
        return self if self.by_layer is None else self.by_layer[index]

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_host)


def build_attention_metadata(seqs: list[SeqSpec], block_size: int,
                             device: torch.device | str = "cpu") -> AttentionMetadata:
    """Build metadata for ``seqs``; decodes (query_len 1) must come first."""
    num_decodes = 0
    for i, s in enumerate(seqs):
        if s.query_len < 1 or s.context_len < s.query_len:
            raise ValueError(f"sequence {i}: query_len {s.query_len}, context_len {s.context_len}")
        if len(s.block_table) * block_size < s.context_len:
            raise ValueError(f"sequence {i}: block table too short for {s.context_len} tokens")
        if s.query_len == 1 and num_decodes == i:
            num_decodes += 1
    slots: list[int] = []
    for s in seqs:
        start = s.context_len - s.query_len
        for p in range(start, s.context_len):
            slots.append(s.block_table[p // block_size] * block_size + p % block_size)
    max_blocks = max((len(s.block_table) for s in seqs), default=0)
    tables = [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in seqs]
    qlens = [s.query_len for s in seqs]
    starts = [0]
    for q in qlens:
        starts.append(starts[-1] + q)
    as_long = dict(dtype=torch.long, device=device)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, **as_long),
        query_start_loc=torch.tensor(starts, **as_long),
        context_lens=torch.tensor([s.context_len for s in seqs], **as_long),
        block_tables=torch.tensor(tables, **as_long).view(len(seqs), max_blocks),
        num_decodes=num_decodes,
        query_lens_host=qlens,
        context_lens_host=[s.context_len for s in seqs],
    )


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, window: int = 0, softcap: float = 0.0,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each sequence's queries over its cached context (with
    ``window`` > 0, over the last ``window`` positions up to each query's own; with
    ``softcap`` > 0, each score soft-capped to ``softcap * tanh(score / softcap)``; with
    ``sinks``, float32 ``[heads]``, a sink logit in each head's softmax: gpt-oss).

    ``q`` is ``[T, heads, head_dim]``; ``k``/``v`` are this step's new keys and
    values ``[T, kv_heads, head_dim]`` (already written to the caches).
    Returns ``[T, heads, head_dim]``.
    """
    d = meta.num_decodes
    if d == meta.num_seqs:
        return decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                max(meta.context_lens_host), scale, window, softcap, sinks)
    out = q.new_empty(q.shape)
    if d:
        out[:d] = decode_attention(q[:d], k_cache, v_cache, meta.block_tables[:d],
                                   meta.context_lens[:d], max(meta.context_lens_host[:d]), scale, window, softcap,
                                   sinks)
    out[d:] = prefill_attention(q[d:], k[d:], v[d:], k_cache, v_cache, meta.block_tables[d:],
                                meta.query_lens_host[d:], meta.context_lens_host[d:], scale, window, softcap,
                                sinks)
    return out

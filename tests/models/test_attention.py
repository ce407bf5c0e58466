"""Paged attention (write_kv + paged_attention) equals plain dense causal attention.

Every test runs twice: with the fused decode kernel and with the plain-torch path.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from models import kv_cache, ops
from models.attention import SeqSpec, build_attention_metadata, paged_attention
from models.ops import write_kv

@pytest.fixture(autouse=True, params=[True, False], ids=["kernels", "torch"])
def kernels(request):
    ops.set_kernels_enabled(request.param)
    yield request.param
    ops.set_kernels_enabled(True)


KV_HEADS = 2
HEAD_DIM = 16
SCALE = HEAD_DIM ** -0.5


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0,
                    softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(QK^T * scale + causal mask) V in float64, KV heads repeated for each query group.

    ``q`` is ``[n, heads, d]``, the last ``n`` positions of a context ``k``/``v`` ``[ctx, kv_heads, d]``;
    with ``window``, a query at position p sees keys p - window + 1 .. p only; with ``softcap``,
    the scores are ``softcap * tanh(score / softcap)`` (Gemma 2); with ``sinks`` ``[heads]``,
    each head's softmax has one more logit, whose probability is dropped (gpt-oss).
    """
    group = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    n, ctx = q.shape[0], k.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k) * SCALE
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    query_pos = torch.arange(n)[:, None] + (ctx - n)
    keys = torch.arange(ctx)[None, :]
    hidden = keys > query_pos
    if window:
        hidden |= keys <= query_pos - window
    scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is None:
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    sink = sinks.double()[:, None, None].expand(-1, n, 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", probs, v)


@dataclass
class Case:
    """A batch ready for one attention call, plus each sequence's whole K/V for the reference."""

    q: torch.Tensor  # [T, heads, d]
    k: torch.Tensor  # [T, kv_heads, d], this step's keys
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    specs: list[SeqSpec]
    block_size: int
    full_k: list[torch.Tensor]  # per sequence [context_len, kv_heads, d]
    full_v: list[torch.Tensor]
    window: int = 0  # a sliding window (0: none)
    softcap: float = 0.0  # attention logit soft-capping (0: none)
    sinks: torch.Tensor | None = None  # a sink logit per query head (None: none)

    def run(self) -> list[torch.Tensor]:
        """write_kv then paged_attention, as a model layer does; outputs split per sequence."""
        meta = build_attention_metadata(self.specs, self.block_size)
        write_kv(self.k_cache, self.v_cache, self.k, self.v, meta.slot_mapping)
        out = paged_attention(self.q, self.k, self.v, self.k_cache, self.v_cache, meta, SCALE, self.window,
                              self.softcap, self.sinks)
        return list(out.split([s.query_len for s in self.specs]))

    def reference(self) -> list[torch.Tensor]:
        qs = self.q.split([s.query_len for s in self.specs])
        return [dense_attention(q, k, v, self.window, self.softcap, self.sinks)
                for q, k, v in zip(qs, self.full_k, self.full_v)]


def make_case(lengths: list[tuple[int, int]], block_size: int, group: int, seed: int = 0,
              head_dim: int = HEAD_DIM, window: int = 0, softcap: float = 0.0, q_scale: float = 1.0) -> Case:
    """Random data for sequences given as ``(query_len, context_len)``, decodes first.

    Each sequence gets blocks from a random permutation of the pool (with spare
    blocks), so tables are shuffled and non-contiguous; its cached prefix
    (``context_len - query_len`` tokens) is already in the cache, whose other
    slots hold random garbage that must never be read. The caches are head-major within a
    block, as ``kv_cache.allocate`` makes them (tests/models/test_ops.py holds the kernels'
    other packing to the same bits).
    """
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    needed = [kv_cache.cdiv(ctx, block_size) for _, ctx in lengths]
    pool = torch.randperm(sum(needed) + 5, generator=gen).tolist()
    k_cache = randn(len(pool), KV_HEADS, block_size, head_dim).transpose(1, 2)
    v_cache = randn(len(pool), KV_HEADS, block_size, head_dim).transpose(1, 2)
    specs, qs, ks, vs, full_k, full_v = [], [], [], [], [], []
    for (qlen, ctx), n in zip(lengths, needed):
        table, pool = pool[:n], pool[n:]
        if n > 1 and table == sorted(table):
            table.reverse()  # an ascending table could hide a gather that ignores the order
        k, v = randn(ctx, KV_HEADS, head_dim), randn(ctx, KV_HEADS, head_dim)
        for p in range(ctx - qlen):  # the cached prefix
            k_cache[table[p // block_size], p % block_size] = k[p]
            v_cache[table[p // block_size], p % block_size] = v[p]
        specs.append(SeqSpec(qlen, ctx, table))
        qs.append(q_scale * randn(qlen, KV_HEADS * group, head_dim))
        ks.append(k[ctx - qlen:])
        vs.append(v[ctx - qlen:])
        full_k.append(k)
        full_v.append(v)
    return Case(torch.cat(qs), torch.cat(ks), torch.cat(vs), k_cache, v_cache, specs, block_size,
                full_k, full_v, window, softcap)


def assert_matches_reference(case: Case) -> None:
    for i, (got, want) in enumerate(zip(case.run(), case.reference(), strict=True)):
        diff = (got.double() - want).abs().max().item()
        assert diff < 1e-5, f"sequence {i} ({case.specs[i]}): max |diff| {diff:.2e}"


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_mixed_batch_matches_dense_attention(block_size: int, group: int) -> None:
    # Decodes of 1, 17 and 40 tokens, a fresh 23-token prompt, a 9-token chunk after 32 cached.
    lengths = [(1, 1), (1, 17), (1, 40), (23, 23), (9, 41)]
    assert_matches_reference(make_case(lengths, block_size, group))


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_decode_only_batch_matches_dense_attention(block_size: int) -> None:
    assert_matches_reference(make_case([(1, 70), (1, 5), (1, 33)], block_size, group=3))


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_prefill_only_batch_matches_dense_attention(block_size: int) -> None:
    # A one-token prompt, a prompt of exactly one block, chunks after cached prefixes.
    lengths = [(1, 1), (16, 16), (5, 37), (30, 31)]
    assert_matches_reference(make_case(lengths, block_size, group=8))


@pytest.mark.parametrize("head_dim", [16, 64, 128])  # the generic loop, and the two unrolled ones
@pytest.mark.parametrize("window", [1, 5, 16, 17])
@pytest.mark.parametrize("block_size", [1, 16])
def test_sliding_window_batch_matches_dense_attention(block_size: int, window: int, head_dim: int) -> None:
    # Decodes and chunks whose windows start inside a block, at a block's start, or reach
    # back past the context's start; queries sharing a KV head in passes of 1, 2 and 3.
    lengths = [(1, 1), (1, 17), (1, 40), (23, 23), (9, 41), (30, 31)]
    for group in (1, 3, 4):
        assert_matches_reference(make_case(lengths, block_size, group, head_dim=head_dim, window=window))


@pytest.mark.parametrize("head_dim", [16, 64, 256])  # the generic loop, an unrolled one, Gemma 2's size
@pytest.mark.parametrize("window", [0, 5])
def test_soft_capped_scores_match_dense_attention(window: int, head_dim: int) -> None:
    # Queries scaled up so that scores reach the cap's bend (|score| ~ cap), where tanh is far
    # from the identity: a kernel that skipped or misplaced the capping would miss by far more.
    lengths = [(1, 1), (1, 17), (1, 40), (23, 23), (9, 41)]
    for group in (1, 3):
        case = make_case(lengths, 16, group, head_dim=head_dim, window=window, softcap=4.0, q_scale=4.0)
        assert_matches_reference(case)


@pytest.mark.parametrize("head_dim", [16, 64])  # the generic loop, an unrolled one
@pytest.mark.parametrize("window", [0, 5])
def test_attention_sinks_match_dense_attention(window: int, head_dim: int) -> None:
    # gpt-oss: each head's sink logit takes its share of the softmax. Sinks from -2 to 6 (the
    # scores are ~N(0, 1)): a large one leaves the keys little, a kernel that dropped it would
    # miss by the whole output; a mixed batch of decodes and chunks, heads in passes of 1-3.
    lengths = [(1, 1), (1, 17), (1, 40), (23, 23), (9, 41)]
    for group in (1, 3):
        case = make_case(lengths, 16, group, head_dim=head_dim, window=window)
        case.sinks = torch.linspace(-2.0, 6.0, KV_HEADS * group)
        assert_matches_reference(case)


def _spaced(cache: torch.Tensor, spare: int) -> torch.Tensor:
    """``cache``'s values in a tensor whose blocks lie ``spare`` more elements apart, the
    gaps filled with garbage (how a Gemma 4 windowed layer views the slot it shares with a
    full layer of twice its head size: ``kv_cache.allocate``)."""
    blocks, block_size, heads, row = cache.shape
    page = cache[0].numel()
    pool = torch.full((blocks, page + spare), float("nan"))
    spaced = pool[:, :page].view(blocks, heads, block_size, row).transpose(1, 2)  # (head-major, as allocate's)
    spaced.copy_(cache)
    return spaced


@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("window", [0, 5])
def test_caches_with_blocks_spaced_apart_match_dense_attention(window: int, head_dim: int) -> None:
    # The kernels read a block's place from the cache's stride(0), the cache writes too:
    # NaN in the gaps reaches the output of any read or write that assumes packed blocks.
    lengths = [(1, 1), (1, 17), (1, 40), (23, 23), (9, 41)]
    case = make_case(lengths, 16, 3, head_dim=head_dim, window=window)
    case.k_cache, case.v_cache = _spaced(case.k_cache, 96), _spaced(case.v_cache, 96)
    assert case.k_cache.stride(0) > case.k_cache[0].numel() and kv_cache.paged_layout(case.k_cache)
    assert_matches_reference(case)
    assert case.k_cache.as_strided((case.k_cache.shape[0], 96), (case.k_cache.stride(0), 1),
                                   case.k_cache[0].numel()).isnan().all(), "a write landed in a gap"


def test_write_kv_stores_each_token_in_its_slot() -> None:
    block_size = 4
    k_cache = torch.zeros(6, block_size, KV_HEADS, HEAD_DIM)
    v_cache = torch.zeros(6, block_size, KV_HEADS, HEAD_DIM)
    k, v = torch.randn(3, KV_HEADS, HEAD_DIM), torch.randn(3, KV_HEADS, HEAD_DIM)
    slots = torch.tensor([5 * block_size + 3, 0, 2 * block_size + 1])

    write_kv(k_cache, v_cache, k, v, slots)

    for i, (block, offset) in enumerate([(5, 3), (0, 0), (2, 1)]):
        assert torch.equal(k_cache[block, offset], k[i])
        assert torch.equal(v_cache[block, offset], v[i])
    assert torch.count_nonzero(k_cache.flatten(0, 1).abs().sum((1, 2))) == 3


def test_sequence_reads_a_block_its_sibling_writes_in_the_same_step() -> None:
    # Prefix-cache hit on a sibling: B shares A's first block, which A fills in this very step.
    block_size, group = 16, 2
    gen = torch.Generator().manual_seed(1)
    k_cache = torch.randn(4, block_size, KV_HEADS, HEAD_DIM, generator=gen)
    v_cache = torch.randn(4, block_size, KV_HEADS, HEAD_DIM, generator=gen)
    k_a, v_a = torch.randn(2, 16, KV_HEADS, HEAD_DIM, generator=gen)
    k_b, v_b = torch.randn(2, 5, KV_HEADS, HEAD_DIM, generator=gen)
    q_a = torch.randn(16, KV_HEADS * group, HEAD_DIM, generator=gen)
    q_b = torch.randn(5, KV_HEADS * group, HEAD_DIM, generator=gen)
    case = Case(torch.cat([q_a, q_b]), torch.cat([k_a, k_b]), torch.cat([v_a, v_b]), k_cache, v_cache,
                [SeqSpec(16, 16, [2]), SeqSpec(5, 21, [2, 0])], block_size,
                full_k=[k_a, torch.cat([k_a, k_b])], full_v=[v_a, torch.cat([v_a, v_b])])
    assert_matches_reference(case)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.int8])
def test_narrow_caches_for_float32_queries(cache_dtype: torch.dtype) -> None:
    # --kv-cache-dtype float16 / int8: keys and values are stored rounded (int8:
    # codes and a scale per row) and read back as float32, for decodes and for
    # a chunk after a cached prefix. The reference attends to the rounded values.
    case = make_case([(1, 17), (1, 40), (9, 41)], block_size=16, group=3)
    case.k_cache, case.v_cache = (kv_cache.to_cache_rows(c, cache_dtype) for c in (case.k_cache, case.v_cache))
    rounded = [[kv_cache.from_cache_rows(kv_cache.to_cache_rows(x, cache_dtype), torch.float32) for x in xs]
               for xs in (case.full_k, case.full_v)]
    case.full_k, case.full_v = rounded

    for i, (got, want) in enumerate(zip(case.run(), case.reference(), strict=True)):
        assert got.dtype == torch.float32
        diff = (got.double() - want).abs().max().item()
        assert diff < 1e-3, f"sequence {i}: max |diff| {diff:.2e}"
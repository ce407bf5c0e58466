"""Draft-model proposals for speculative decoding (``--speculative draft``).

A smaller model with the target's vocabulary runs a few greedy tokens ahead
of each decoding request, over its own paged KV cache (its own blocks, its
own ``ModelRunner``); the engine verifies the proposals in its normal step, as
it does prompt lookup's. Per step the draft runs ``num_tokens`` forwards for
all requests at once: the first catches each request up on the tokens its
cache lacks (the whole prompt on a request's first step, after that the
tokens accepted since; at most the engine's step budget per step) and
proposes one token, each later one is a decode of the proposal before it.

The draft's cache holds K/V for ``_DraftSeq.tokens``. When the target rejects
a proposal, the draft's tokens and the request's part ways there: only their
common prefix is kept (its K/V are still right, since every position depends
only on the tokens before it) and the rest is computed again. The positions
past it are simply overwritten, so nothing is freed until the request ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.block_pool import BlockPool
from engine.model_runner import Chunk, ModelRunner
from models import ops
from models.kv_cache import cdiv
from models.loader import LoadedModel


@dataclass
class _DraftSeq:
    """One request's blocks in the draft's cache and the tokens whose K/V they hold."""

    block_ids: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class DraftProposer:
    """Greedy proposals of up to ``num_tokens`` tokens from a draft model.

    ``num_blocks`` blocks of ``block_size`` tokens are the draft's cache. A
    request that cannot get the blocks it needs gets no proposals (its blocks
    go back), so the draft never holds up the target. ``vocab_size``: the ids
    the target samples from; the draft's picks are the argmax over them.
    ``max_catch_up``: the most tokens one call feeds to catch requests up (the
    engine's step budget), so a long prompt reaches the draft over several
    steps, as it reached the target, instead of stalling one; a request gets
    proposals once its cache has caught up.
    """

    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                 num_tokens: int, vocab_size: int, max_catch_up: int) -> None:
        self.runner = ModelRunner(loaded, num_blocks, block_size, kv_dtype)
        self.block_size = block_size
        self.num_tokens = num_tokens
        self.vocab_size = vocab_size
        self.max_catch_up = max_catch_up
        self.max_positions = loaded.config.max_position_embeddings
        self._blocks = BlockPool(num_blocks, block_size)  # no prefix caching: nothing is shared
        self._seqs: dict[str, _DraftSeq] = {}

    @property
    def num_free_blocks(self) -> int:
        return self._blocks.num_free_blocks

    def propose(self, requests: list[tuple[str, list[int], int]]) -> list[list[int]]:
        """For each ``(request id, its tokens, limit)``: up to ``min(limit, num_tokens)``
        tokens the draft picks greedily after ``tokens``."""
        out: list[list[int]] = [[] for _ in requests]
        active: list[tuple[int, _DraftSeq, int]] = []  # (index in requests, its state, tokens wanted)
        chunks: list[Chunk] = []
        catching_up: list[tuple[_DraftSeq, Chunk]] = []  # fed this call, too far behind to propose
        budget = self.max_catch_up
        for i, (request_id, tokens, limit) in enumerate(requests):
            # Positions up to len(tokens) + k - 2 get K/V (the last proposal is never fed).
            k = min(limit, self.num_tokens, self.max_positions - len(tokens) + 1)
            if k <= 0:
                continue
            seq = self._seqs.get(request_id) or _DraftSeq()
            # What the cache holds of these tokens, less at least the last one: its logits are needed.
            kept = min(_common_prefix(seq.tokens, tokens), len(tokens) - 1)
            del seq.tokens[kept:]
            behind = len(tokens) - kept
            fed = min(behind, budget)
            if fed == 0:
                continue  # this step's budget is spent: it catches up in a later one
            if not self._reserve(seq, len(tokens) + k - 1 if fed == behind else kept + fed):
                self.forget(request_id)
                continue
            budget -= fed
            self._seqs[request_id] = seq
            if fed < behind:
                catching_up.append((seq, Chunk(tokens[kept:kept + fed], kept, [seq.block_ids], 0)))
                continue
            active.append((i, seq, k))
            chunks.append(Chunk(tokens[kept:], kept, [seq.block_ids], 1))
        # The first forward also feeds the requests still catching up (none of their rows is sampled).
        first = chunks + [chunk for _, chunk in catching_up]
        logits = self.runner.run(first) if first else None
        for seq, chunk in catching_up:
            seq.tokens.extend(chunk.token_ids)
        while chunks:
            picks = ops.argmax(logits[:, :self.vocab_size]).tolist()
            next_active, next_chunks = [], []
            for (i, seq, k), chunk, token in zip(active, chunks, picks):
                seq.tokens.extend(chunk.token_ids)
                out[i].append(token)
                if len(out[i]) < k:
                    next_active.append((i, seq, k))
                    next_chunks.append(Chunk([token], len(seq.tokens), [seq.block_ids], 1))
            active, chunks = next_active, next_chunks
            if chunks:
                logits = self.runner.run(chunks)
        return out

    def _reserve(self, seq: _DraftSeq, positions: int) -> bool:
        """Blocks for ``positions`` tokens in ``seq``'s table, if the cache has them."""
        need = cdiv(positions, self.block_size) - len(seq.block_ids)
        if need > self._blocks.num_free_blocks:
            return False
        seq.block_ids += self._blocks.allocate(max(need, 0))
        return True

    def forget(self, request_id: str) -> None:
        """The request ended (or lost its place): its blocks go back."""
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self._blocks.free(seq.block_ids)

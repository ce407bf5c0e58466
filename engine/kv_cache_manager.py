"""Per-request block tables on top of the :class:`BlockPool`.

The manager owns the map ``request_id -> block ids``. Token ``p`` of a request
lives in slot ``block_ids[p // block_size] * block_size + p % block_size`` of
the model runner's K/V tensors ``[num_blocks, block_size, kv_heads, head_dim]``.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.block_pool import BlockHash, BlockPool, hash_block_tokens, root_hash
from engine.request import Request
from models.kv_cache import cdiv


@dataclass
class KVCacheStats:
    """Cache occupancy now, and cumulative prefix-cache counters (in tokens)."""

    num_blocks_total: int
    num_blocks_used: int  # blocks with ref count > 0
    usage: float  # used / total, 0..1
    prefix_cache_queries: int  # prompt tokens looked up, once per request
    prefix_cache_hits: int  # of which served by cached blocks


class KVCacheManager:
    """Allocates, shares (prefix caching) and frees the blocks of each request."""

    def __init__(self, num_blocks: int, block_size: int = 16,
                 enable_prefix_caching: bool = True) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._tables: dict[str, list[int]] = {}
        # How many leading blocks of each table are registered in the prefix cache
        # (or were found there), so each block is hashed in once.
        self._num_hashed: dict[str, int] = {}
        # Chained hashes of each request's full blocks; tokens only get appended,
        # so the list only grows.
        self._hashes: dict[str, list[BlockHash]] = {}
        self._queries = 0
        self._hits = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks available to allocate (free cached blocks included)."""
        return self.pool.num_free_blocks

    @property
    def num_requests(self) -> int:
        """Requests that hold a block table."""
        return len(self._tables)

    @property
    def stats(self) -> KVCacheStats:
        """A snapshot of usage and the cumulative prefix-cache counters."""
        used = self.pool.num_used_blocks
        return KVCacheStats(
            num_blocks_total=self.num_blocks,
            num_blocks_used=used,
            usage=used / self.num_blocks,
            prefix_cache_queries=self._queries,
            prefix_cache_hits=self._hits,
        )

    def get_block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block table (empty when it holds none)."""
        return list(self._tables.get(request_id, ()))

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest run of cached full blocks matching the start of ``request.all_token_ids``.

        Returns ``(block ids, number of tokens they cover)``. Never covers every
        token: at least one must still run so the model yields logits to sample
        from. The lookup takes no refs; pass the blocks to :meth:`allocate_slots`
        in the same step. Hit counters are recorded there, on a successful first
        admission, so a request that waits for blocks is not counted twice.
        """
        if not self.enable_prefix_caching:
            return [], 0
        tokens = request.all_token_ids
        max_blocks = (len(tokens) - 1) // self.block_size
        hashes = self._block_hashes(request, tokens, max_blocks)
        bs = self.block_size
        block_ids: list[int] = []
        for i in range(max_blocks):
            block_id = self.pool.get_cached_block(hashes[i], tokens[i * bs:(i + 1) * bs])
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids, len(block_ids) * bs

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[int] | None = None, num_lookahead: int = 0) -> bool:
        """Grow the request's table to cover its computed tokens plus ``num_new_tokens``,
        plus ``num_lookahead`` slots for proposed tokens (speculative decoding) that
        are not known tokens: they are never registered in the prefix cache.

        ``computed_blocks`` (from :meth:`get_computed_blocks`, only when the
        request holds no blocks yet) are shared: they take a ref and count as
        computed on top of ``request.num_computed_tokens``. Returns False and
        changes nothing when too few blocks are free.

        Every block that becomes full with the tokens known now is registered in
        the prefix cache at once, so a request admitted later in the same step
        can share it: the model writes a layer's K/V for the whole batch before
        any attention reads it.
        """
        rid = request.request_id
        computed = computed_blocks or []
        table = self._tables.get(rid)
        admitting = table is None
        assert admitting or not computed, "computed blocks are only taken at admission"
        num_computed = request.num_computed_tokens + len(computed) * self.block_size
        num_total = num_computed + num_new_tokens
        assert num_total <= request.num_tokens, "cannot schedule tokens that are not known yet"
        num_held = len(computed) if admitting else len(table)
        num_needed = max(cdiv(num_total + num_lookahead, self.block_size) - num_held, 0)
        # Cache hits sitting in the free queue stop being free once touched.
        num_hits_free = sum(1 for b in computed if self.pool.ref_count(b) == 0)
        if num_needed + num_hits_free > self.pool.num_free_blocks:
            return False

        if admitting:
            table = self._tables[rid] = []
            self._num_hashed[rid] = len(computed)
            # A request scoring its prompt cannot use hits (``Request.needs_prompt_logits``):
            # it was not looked up, so it does not count against the hit rate.
            if self.enable_prefix_caching and request.num_preemptions == 0 and not request.needs_prompt_logits:
                self._queries += request.num_tokens
                self._hits += len(computed) * self.block_size
        self.pool.touch(computed)
        table.extend(computed)
        table.extend(self.pool.allocate(num_needed))
        if self.enable_prefix_caching:
            self._register_full_blocks(request, num_total)
        return True

    def trim(self, request: Request) -> None:
        """Give back the blocks past the request's known tokens (the slots of rejected
        proposals); none of them is in the prefix cache."""
        table = self._tables[request.request_id]
        keep = cdiv(request.num_tokens, self.block_size)
        assert self._num_hashed[request.request_id] <= keep, "a registered block holds unknown tokens"
        if len(table) > keep:
            extra = table[keep:]
            del table[keep:]
            self.pool.free(reversed(extra))

    def free(self, request_id: str) -> None:
        """Release the request's blocks. Safe to call again or for an unknown id.

        The table is freed tail first, so among cached blocks a request's last
        blocks (the least likely to be shared) are evicted before its first ones.
        """
        table = self._tables.pop(request_id, None)
        self._num_hashed.pop(request_id, None)
        self._hashes.pop(request_id, None)
        if table:
            self.pool.free(reversed(table))

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks; refused (False) while any block is in use."""
        return self.pool.reset_prefix_cache()

    def _register_full_blocks(self, request: Request, num_tokens: int) -> None:
        rid = request.request_id
        bs = self.block_size
        num_full = num_tokens // bs
        start = self._num_hashed[rid]
        if num_full <= start:
            return
        tokens = request.all_token_ids
        hashes = self._block_hashes(request, tokens, num_full)
        table = self._tables[rid]
        for i in range(start, num_full):
            self.pool.cache_block(table[i], hashes[i], tokens[i * bs:(i + 1) * bs])
        self._num_hashed[rid] = num_full

    def _block_hashes(self, request: Request, tokens: list[int], num_blocks: int) -> list[BlockHash]:
        """The chained hashes of the first ``num_blocks`` full blocks of ``tokens``.

        A LoRA adapter's blocks chain from a root of their own: the same tokens
        have other keys and values under another adapter, and must never be shared.
        So do a salted request's (``cache_salt``): only the same salt shares them.
        """
        hashes = self._hashes.setdefault(request.request_id, [])
        bs = self.block_size
        root = root_hash(request.adapter, request.sampling_params.cache_salt)
        for i in range(len(hashes), num_blocks):
            parent = hashes[-1] if hashes else root
            hashes.append(hash_block_tokens(parent, tokens[i * bs:(i + 1) * bs]))
        return hashes

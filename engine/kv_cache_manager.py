"""Per-request block tables on top of the :class:`BlockPool`.

The manager owns the map ``request_id -> block tables``: one table per group of
layers of the cache's layout (``models.kv_cache.KVLayout``; one group unless
the model has sliding-window layers beside full ones). Token ``p`` of a request
lives, for a layer of group ``g``, in slot
``tables[g][p // block_size] * block_size + p % block_size`` of that layer's
K/V tensors ``[num_blocks, block_size, kv_heads, head_dim]``.

A windowed group (a window of ``w`` positions) gives its blocks back once the
request's next query (position ``num_computed_tokens`` or later) can no longer
see them: the entries become ``NULL_BLOCK`` (never read: the attention kernels
start at the window). All groups allocate from one pool, so a request's budget
is its full groups' tables plus its windowed groups' last ``w`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.block_pool import BlockHash, BlockPool, hash_block_tokens, root_hash
from engine.request import Request
from models.kv_cache import cdiv

# A windowed group's table entry whose block was given back (out of the window).
NULL_BLOCK = -1

# A prefix hit as get_computed_blocks returns it: one list of blocks per group.
GroupBlocks = list[list[int]]


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
                 enable_prefix_caching: bool = True, group_windows: tuple[int, ...] = (0,)) -> None:
        """``group_windows``: each group's sliding window (0: full attention), the
        layout's ``group_windows``."""
        if not group_windows or any(w < 0 for w in group_windows):
            raise ValueError(f"group_windows must name at least one group, each window >= 0, got {group_windows}")
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.group_windows = group_windows
        self._tables: dict[str, list[list[int]]] = {}
        # How many leading blocks of each table are registered in the prefix cache
        # (or were found there), so each block is hashed in once (the same for every group).
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
        """Requests that hold block tables."""
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

    def get_block_ids(self, request_id: str, group: int = 0) -> list[int]:
        """A copy of the request's block table of ``group`` (empty when it holds none)."""
        tables = self._tables.get(request_id)
        return list(tables[group]) if tables else []

    def get_block_tables(self, request_id: str) -> list[list[int]]:
        """Copies of the request's block tables, one per group."""
        return [list(t) for t in self._tables.get(request_id, ())]

    def get_computed_blocks(self, request: Request, max_blocks: int | None = None) -> tuple[GroupBlocks, int]:
        """Longest run of cached full blocks matching the start of ``request.all_token_ids``
        (at most ``max_blocks``).

        Returns ``(each group's blocks, number of tokens they cover)``. A full group's
        blocks cover every token of the hit; a windowed group's those its next query
        can see, the others ``NULL_BLOCK``. Never covers every token: at least one must
        still run so the model yields logits to sample from. The lookup takes no refs;
        pass the blocks to :meth:`allocate_slots` in the same step. Hit counters are
        recorded there, on a successful first admission, so a request that waits for
        blocks is not counted twice.
        """
        empty: GroupBlocks = [[] for _ in self.group_windows]
        if not self.enable_prefix_caching:
            return empty, 0
        tokens = request.all_token_ids
        limit = (len(tokens) - 1) // self.block_size
        if max_blocks is not None:
            limit = min(limit, max_blocks)
        hashes = self._block_hashes(request, tokens, limit)
        found = [self._cached_run(g, hashes, tokens, limit) for g in range(len(self.group_windows))]
        # The longest hit every group can serve; a windowed group needs only its window's blocks.
        for n in range(min(len(run) for g, run in enumerate(found) if not self.group_windows[g])
                       if 0 in self.group_windows else limit, 0, -1):
            if all(self._serves(g, run, n) for g, run in enumerate(found)):
                skip = [self._num_skipped(g, n * self.block_size) for g in range(len(found))]
                return [[NULL_BLOCK] * s + run[s:n] for s, run in zip(skip, found)], n * self.block_size
        return empty, 0

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: GroupBlocks | None = None, num_lookahead: int = 0) -> bool:
        """Grow the request's tables to cover its computed tokens plus ``num_new_tokens``,
        plus ``num_lookahead`` slots for proposed tokens (speculative decoding) that
        are not known tokens: they are never registered in the prefix cache.

        ``computed_blocks`` (from :meth:`get_computed_blocks`, only when the
        request holds no blocks yet) are shared: they take a ref and count as
        computed on top of ``request.num_computed_tokens``. A windowed group first
        gives back the blocks no query to come can see. Returns False and
        changes nothing else when too few blocks are free.

        Every block that becomes full with the tokens known now is registered in
        the prefix cache at once, so a request admitted later in the same step
        can share it: the model writes a layer's K/V for the whole batch before
        any attention reads it.
        """
        rid = request.request_id
        tables = self._tables.get(rid)
        admitting = tables is None
        computed = computed_blocks if computed_blocks is not None else [[] for _ in self.group_windows]
        assert admitting or not any(computed), "computed blocks are only taken at admission"
        num_hit = len(computed[0]) * self.block_size
        num_computed = request.num_computed_tokens + num_hit
        num_total = num_computed + num_new_tokens
        assert num_total <= request.num_tokens, "cannot schedule tokens that are not known yet"
        if not admitting:
            self._free_skipped(rid, num_computed)
        held = computed if admitting else tables
        num_entries = cdiv(num_total + num_lookahead, self.block_size)
        num_needed = sum(max(num_entries - len(t), 0) for t in held)
        # Cache hits sitting in the free queue stop being free once touched.
        num_hits_free = sum(1 for t in computed for b in t if b != NULL_BLOCK and self.pool.ref_count(b) == 0)
        if num_needed + num_hits_free > self.pool.num_free_blocks:
            return False

        if admitting:
            tables = self._tables[rid] = [[] for _ in self.group_windows]
            self._num_hashed[rid] = len(computed[0])
            # A request scoring its prompt cannot use hits (``Request.needs_prompt_logits``):
            # it was not looked up, so it does not count against the hit rate.
            if self.enable_prefix_caching and request.num_preemptions == 0 and not request.needs_prompt_logits:
                self._queries += request.num_tokens
                self._hits += num_hit
        for table, hit in zip(tables, computed):
            self.pool.touch(b for b in hit if b != NULL_BLOCK)
            table.extend(hit)
            table.extend(self.pool.allocate(max(num_entries - len(table), 0)))
        if self.enable_prefix_caching:
            self._register_full_blocks(request, num_total)
        return True

    def trim(self, request: Request) -> None:
        """Give back the blocks past the request's known tokens (the slots of rejected
        proposals); none of them is in the prefix cache."""
        keep = cdiv(request.num_tokens, self.block_size)
        assert self._num_hashed[request.request_id] <= keep, "a registered block holds unknown tokens"
        for table in self._tables[request.request_id]:
            if len(table) > keep:
                extra = table[keep:]
                del table[keep:]
                self.pool.free(reversed(extra))

    def free(self, request_id: str) -> None:
        """Release the request's blocks. Safe to call again or for an unknown id.

        Each table is freed tail first, so among cached blocks a request's last
        blocks (the least likely to be shared) are evicted before its first ones.
        """
        tables = self._tables.pop(request_id, None)
        self._num_hashed.pop(request_id, None)
        self._hashes.pop(request_id, None)
        for table in tables or ():
            self.pool.free(b for b in reversed(table) if b != NULL_BLOCK)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks; refused (False) while any block is in use."""
        return self.pool.reset_prefix_cache()

    def _num_skipped(self, group: int, num_computed: int) -> int:
        """Leading blocks of ``group`` that no query at ``num_computed`` or later sees."""
        window = self.group_windows[group]
        return max(num_computed - window + 1, 0) // self.block_size if window else 0

    def _free_skipped(self, request_id: str, num_computed: int) -> None:
        for g, table in enumerate(self._tables[request_id]):
            for i in range(min(self._num_skipped(g, num_computed), len(table))):
                if table[i] != NULL_BLOCK:
                    self.pool.free((table[i],))
                    table[i] = NULL_BLOCK

    def _cached_run(self, group: int, hashes: list[BlockHash], tokens: list[int], limit: int) -> list[int | None]:
        """Each of the first ``limit`` blocks of ``group`` in the cache (None: not there);
        a full group's run stops at its first miss."""
        bs = self.block_size
        run: list[int | None] = []
        for i in range(limit):
            block_id = self.pool.get_cached_block(_group_hash(hashes[i], group), tokens[i * bs:(i + 1) * bs])
            if block_id is None and not self.group_windows[group]:
                break
            run.append(block_id)
        return run

    def _serves(self, group: int, run: list[int | None], n: int) -> bool:
        """Whether ``group``'s cached blocks serve a hit of ``n`` blocks."""
        return len(run) >= n and all(b is not None for b in run[self._num_skipped(group, n * self.block_size):n])

    def _register_full_blocks(self, request: Request, num_tokens: int) -> None:
        rid = request.request_id
        bs = self.block_size
        num_full = num_tokens // bs
        start = self._num_hashed[rid]
        if num_full <= start:
            return
        tokens = request.all_token_ids
        hashes = self._block_hashes(request, tokens, num_full)
        for g, table in enumerate(self._tables[rid]):
            for i in range(start, num_full):
                if table[i] != NULL_BLOCK:
                    self.pool.cache_block(table[i], _group_hash(hashes[i], g), tokens[i * bs:(i + 1) * bs])
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


def _group_hash(block_hash: BlockHash, group: int) -> BlockHash:
    """The key of a block of ``group``: each group's blocks hold other layers' K/V."""
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")

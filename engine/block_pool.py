"""Physical KV cache blocks: a free queue, ref counts and the prefix-cache map.

The pool knows nothing about requests. It hands out block ids, counts who
holds each block, and remembers which full blocks hold which tokens so that a
later request with the same prefix can reuse them.

Free queue order decides what gets reused first:

* a freed block without a hash goes to the *front* (its contents are useless);
* a freed block with a hash goes to the *end* and keeps its hash (lazy
  eviction): it is still a cache hit until the queue reaches it, and it is
  evicted (its hash dropped) only when it is popped for reuse. So the cached
  blocks are evicted in least-recently-freed order.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

BlockHash = bytes

# Stands in for the parent of a sequence's first block.
_ROOT_HASH: BlockHash = b"\x00" * 32


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Chained hash of one full block: (parent block's hash, the block's token ids).

    NOTE: SHA-256 rather than Python's ``hash()``: a multi-tenant server must not
    let one client craft a prompt whose block collides with another client's
    cached block. Hits are still confirmed by comparing token ids.
    """
    h = hashlib.sha256(parent_hash or _ROOT_HASH)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def root_hash(adapter: str | None, cache_salt: str | None) -> BlockHash | None:
    """The parent hash of a sequence's first block: None (``_ROOT_HASH``) for the base
    model unsalted; a LoRA adapter's own root, since the same tokens have other keys and
    values under it; a request's ``cache_salt`` (vLLM's) chained onto either, so that only
    requests of the same salt share blocks (a tenant cannot time another's cache hits)."""
    root = hashlib.sha256(b"lora\0" + adapter.encode()).digest() if adapter is not None else None
    if cache_salt is not None:
        root = hashlib.sha256((root or _ROOT_HASH) + b"salt\0" + cache_salt.encode()).digest()
    return root


@dataclass
class KVBlock:
    """Bookkeeping for one physical block (the K/V tensors live in the model runner)."""

    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    # The tokens the hash was computed from, to confirm a hit is not a collision.
    token_ids: tuple[int, ...] = ()


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` tokens, with prefix caching.

    Block ids are ``0 .. num_blocks - 1``; a fresh pool hands them out in
    ascending order.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._blocks = [KVBlock(i) for i in range(num_blocks)]
        # Exactly the blocks with ref_count == 0, in reuse order (front first).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, int] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds, cached ones included."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with a ref count above zero."""
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that carry a hash (in use or free)."""
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        """How many block tables hold ``block_id``."""
        return self._blocks[block_id].ref_count

    def free_block_ids(self) -> list[int]:
        """The free queue, front (reused first) to end. For tests and debugging."""
        return list(self._free)

    def get_cached_block(self, block_hash: BlockHash, token_ids: Sequence[int]) -> int | None:
        """The block cached under ``block_hash`` if it really holds ``token_ids``."""
        block_id = self._cached.get(block_hash)
        if block_id is None or self._blocks[block_id].token_ids != tuple(token_ids):
            return None
        return block_id

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks from the front of the free queue, ref count 1 each.

        A cached block taken this way is evicted: its hash leaves the map.
        """
        if num_blocks > len(self._free):
            raise ValueError(
                f"cannot allocate {num_blocks} blocks: only {len(self._free)} are free")
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            block = self._blocks[block_id]
            assert block.ref_count == 0, f"block {block_id} in the free queue is held"
            self._evict(block)
            block.ref_count = 1
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more ref on each block (prefix-cache hits); a free one leaves the queue."""
        for block_id in block_ids:
            block = self._blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one ref on each block, in the order given.

        A block whose count reaches zero joins the free queue: at the end if it
        is cached (reused last), at the front if not (reused first).
        """
        for block_id in block_ids:
            block = self._blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed more often than held"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                self._free.move_to_end(block_id, last=block.block_hash is not None)

    def cache_block(self, block_id: int, block_hash: BlockHash, token_ids: Sequence[int]) -> bool:
        """Register a full block under ``block_hash`` so later requests can hit it.

        Returns False (and leaves the block uncached) when another block already
        holds this hash: two requests computed the same block independently.
        """
        assert len(token_ids) == self.block_size, "only full blocks are cached"
        block = self._blocks[block_id]
        if block.block_hash is not None:
            return block.block_hash == block_hash
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self._cached[block_hash] = block_id
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Refused (False) while any block is in use."""
        if self.num_used_blocks:
            return False
        for block in self._blocks:
            self._evict(block)
        return True

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            block.block_hash = None
            block.token_ids = ()

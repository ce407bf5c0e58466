"""The paged KV cache's storage: its tensors' shape and the int8 row format.

Per layer, K and V each are ``[num_blocks, block_size, num_kv_heads, row]``,
stored head-major within a block (``allocate``: a view of ``[num_blocks,
num_kv_heads, block_size, row]``), as vLLM's CPU cache is: a head's rows of one
block are one run of memory, so decode attention, which reads a head's rows
token after token, streams them (one sequence of OLMoE's shape, 16 KV heads of
128 at 230 tokens: 193-194 -> 70-97 us a layer; docs/notes/2026-12-07.md).
The kernels read either packing (a contiguous, token-major tensor too).
A float cache (float32, float16, bfloat16) stores a head's ``head_dim``
values as they are (``row = head_dim``). An int8 cache stores each (token,
head) row as ``head_dim`` int8 codes followed by its float32 scale in 4
more bytes (``row = head_dim + 4``), as llama.cpp's q8_0 cache does per 32
values: ``x ~= scale * code`` with ``scale = max|x| / 127``. Keeping the
scale inside the row keeps one tensor per K and V, so block tables, slots
and gathers stay the same for every dtype; decode attention reads about
half the bytes of a float16 cache.
"""

from __future__ import annotations

import errno
import mmap
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from models.config import ModelConfig

# Bytes after each int8 row: its float32 scale.
INT8_SCALE_BYTES = 4


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of ``b`` tokens hold ``a`` tokens."""
    return -(a // -b)


def default_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """``--kv-cache-dtype auto``: float16 for a float32 model (half the bytes, as
    llama.cpp's default f16 cache; logits within about 0.03), else the model's dtype."""
    return torch.float16 if model_dtype == torch.float32 else model_dtype


def resolve_dtype(setting: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache dtype of a ``--kv-cache-dtype`` setting: ``auto`` -> ``default_dtype``,
    otherwise the named dtype."""
    if setting != "auto":
        return getattr(torch, setting)
    return default_dtype(model_dtype)


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements per (token, head) row in a cache of ``dtype``."""
    return head_dim + INT8_SCALE_BYTES if dtype == torch.int8 else head_dim


def _itemsize(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


def slot_pages(layout: KVLayout, shapes: Sequence[tuple[int, int]], block_size: int,
               dtype: torch.dtype) -> list[int]:
    """Elements one block takes in each slot tensor (keys or values): the largest of its
    layers' ``block_size * kv_heads * row`` (``shapes``: each layer's ``(kv_heads, head_dim)``;
    layers of other groups share a slot, and Gemma 4's full and windowed layers differ)."""
    pages = [0] * layout.num_slots
    for layer, slot in enumerate(layout.layer_slot):
        heads, dim = shapes[layer]
        pages[slot] = max(pages[slot], block_size * heads * row_width(dim, dtype))
    return pages


def block_bytes(layout: KVLayout, shapes: Sequence[tuple[int, int]], block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block id takes across its slots, keys and values."""
    return 2 * sum(slot_pages(layout, shapes, block_size, dtype)) * _itemsize(dtype)


def allocate(layout: KVLayout, shapes: Sequence[tuple[int, int]], num_blocks: int, block_size: int,
             dtype: torch.dtype, device: torch.device | str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed ``(k_cache, v_cache)`` per layer, ``[num_blocks, block_size, kv_heads, row]`` of
    its ``shapes`` entry; layers of one slot (``layout.layer_slot``) share its memory.

    A slot whose layers differ in shape takes the largest one's bytes a block, and each
    layer views the start of every block: a tensor whose blocks lie further apart than its
    rows fill (``stride(0)``; the kernels read that stride). Within a block the rows are
    head-major (``stride(1)`` is a row, ``stride(2)`` a head's ``block_size`` rows). On the
    CPU the slots are views of one mapping of huge pages (``huge_page_zeros``).
    """
    pages = slot_pages(layout, shapes, block_size, dtype)
    total = 2 * sum(pages) * num_blocks
    if torch.device(device).type == "cpu":
        flat = huge_page_zeros(total * _itemsize(dtype)).view(dtype)
    else:
        flat = torch.zeros(total, dtype=dtype, device=device)
    regions, start = [], 0
    for page in pages:  # each slot's K then V, [num_blocks, page] each
        regions.append(tuple(flat[start + i * num_blocks * page:start + (i + 1) * num_blocks * page]
                             .view(num_blocks, page) for i in range(2)))
        start += 2 * num_blocks * page
    caches = []
    for layer, slot in enumerate(layout.layer_slot):
        heads, dim = shapes[layer]
        row = row_width(dim, dtype)
        caches.append(tuple(r[:, :block_size * heads * row].view(num_blocks, heads, block_size, row).transpose(1, 2)
                            for r in regions[slot]))
    return caches


def paged_layout(cache: torch.Tensor) -> bool:
    """Whether ``cache`` is as the kernels read it: ``[blocks, block_size, heads, row]`` packed
    within a block, head-major (``allocate``'s tensors) or token-major (a contiguous tensor),
    blocks ``stride(0)`` apart (csrc/cache_rows.h ``cache_strides``)."""
    if cache.dim() != 4 or cache.stride(3) != 1:
        return False
    _, block_size, heads, row = cache.shape
    head_major = cache.stride(1) == row and cache.stride(2) == block_size * row
    token_major = cache.stride(2) == row and cache.stride(1) == heads * row
    return (head_major or token_major) and cache.stride(0) >= block_size * heads * row


_MADV_POPULATE_WRITE = 23  # <linux/mman.h>; Python's mmap names it from 3.13 (where the platform has it)


def huge_page_zeros(nbytes: int) -> torch.Tensor:
    """``nbytes`` zeroed bytes (uint8) in an anonymous mapping, held from the start and
    advised for transparent huge pages.

    The pages are claimed here, so a budget the machine cannot hold fails at
    start-up, not mid-request (as ``torch.zeros`` did): ``MADV_POPULATE_WRITE``
    (Linux 5.14) faults them in, zeroed, inside the kernel (0.46 s for a 1.5B
    model's 1.9 GB default cache, where writing zeros from here took 2.5 s);
    on older kernels zeros are written. The advice for 2 MiB pages comes after
    (khugepaged may merge them later): given first, it made the kernel compact
    memory for every 2 MiB page before the start, 3.6-5.4 s for 1.9 GB once a
    model was loaded, for decode attention about 9% faster at 64 sequences
    (docs/performance.md, "A realistic model"). The tensor keeps the mapping alive.
    """
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    data = torch.frombuffer(buf, dtype=torch.uint8)
    try:
        buf.madvise(getattr(mmap, "MADV_POPULATE_WRITE", _MADV_POPULATE_WRITE))
    except OSError as exc:
        if exc.errno != errno.EINVAL:  # not "unknown advice": the memory is not there
            raise ValueError(f"the KV cache's {nbytes / 2**30:.2f} GiB cannot be held in memory ({exc.strerror}); "
                             "lower --kv-cache-memory") from None
        data.zero_()  # a kernel before 5.14: touch every page
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            buf.madvise(advice)
        except OSError:  # a kernel built without THP
            pass
    return data


def to_cache_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``[..., head_dim]`` in the cache's format: a cast, or int8 codes and their scale.

    The rounding is the C++ kernel's: ``code = nearest(x * (127 / max|x|))``,
    ties to even, and ``scale = max|x| / 127``; an all-zero row gets scale 0.
    """
    if dtype != torch.int8:
        return x.to(dtype)
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    # A true division, as the kernel's: ``127.0 / tensor`` is ``tensor.reciprocal() * 127`` in torch,
    # an ulp off for about a quarter of the values.
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    codes = torch.round(xf * inv).to(torch.int8)
    scale = (amax / 127.0).contiguous().view(torch.int8)  # float32 bits as 4 bytes
    return torch.cat([codes, scale], dim=-1)


def from_cache_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows ``[..., row]`` back as ``[..., head_dim]`` values of ``dtype``."""
    if rows.dtype != torch.int8:
        return rows.to(dtype)
    head_dim = rows.shape[-1] - INT8_SCALE_BYTES
    scale = rows[..., head_dim:].contiguous().view(torch.float32)
    return (rows[..., :head_dim].float() * scale).to(dtype)


@dataclass(frozen=True)
class KVLayout:
    """Which block table each layer reads and which of the cache's tensors it uses.

    Layers are grouped by their sliding window (``ModelConfig.layer_windows``;
    0: full attention), as vLLM's hybrid KV cache manager does: every group has
    the same number of layers (``num_slots``; the last group of a kind may have
    fewer), every request one block table per group, and all groups draw block
    ids from one pool. Block id ``b`` of any group is ``num_slots`` layers' K/V:
    slot tensor ``s`` row ``b``. A windowed group gives back the blocks its
    window has left behind (``engine.kv_cache_manager``), so a Gemma 3 sequence
    of 8k tokens holds its five windowed groups' last 512 tokens, not 8k: the
    budget buys block ids of ``num_slots`` layers instead of every layer's.

    A model whose layers all share one window (or none) is one group of all its
    layers: one table, one tensor per layer, as before.
    """

    group_windows: tuple[int, ...]  # each group's window (0: full attention)
    layer_group: tuple[int, ...]  # layer -> its group
    layer_slot: tuple[int, ...]  # layer -> its slot tensor
    num_slots: int  # layers' worth of K/V per block id

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def hybrid(self) -> bool:
        """More than one block table per request."""
        return len(self.group_windows) > 1

    def blocks_for(self, num_tokens: int, block_size: int, chunk: int) -> int:
        """Block ids one sequence of ``num_tokens`` holds at most, running ``chunk``
        tokens a step: each full group covers every token; a windowed group its window
        before the chunk's first query and the chunk."""
        full = cdiv(num_tokens, block_size)
        return sum(full if not w else min(full, cdiv(w - 1 + chunk, block_size) + 1) for w in self.group_windows)


def kv_layout(layer_windows: tuple[int, ...], num_layers: int, max_model_len: int,
              hybrid: bool = True, sources: tuple[int, ...] = ()) -> KVLayout:
    """The grouping of ``num_layers`` layers with these windows (empty: none).

    A window of at least ``max_model_len`` sees every position, so its layers group
    with the full ones. Groups hold as many layers as the rarest kind has (vLLM's
    rule): Gemma 3 270M's 3 full and 15 windowed layers make 6 groups of 3.
    ``hybrid=False``: one group of all layers (every block kept for every layer).
    ``sources``: the layer whose cache each layer reads (Gemma 4's KV-sharing layers read an
    earlier one's; empty: its own): a layer reading another's holds no cache of its own, and
    takes its source's group and slot.
    """
    sources = sources or tuple(range(num_layers))
    owners = [i for i in range(num_layers) if sources[i] == i]
    assert all(sources[sources[i]] == sources[i] for i in range(num_layers)), "a source layer reads its own cache"
    windows = {i: w if 0 < w < max_model_len else 0 for i, w in enumerate(layer_windows or (0,) * num_layers)}
    kinds = sorted({windows[i] for i in owners})
    layer_group = [0] * num_layers
    layer_slot = [0] * num_layers
    if not hybrid or len(kinds) == 1:
        group_windows, size = [kinds[0] if hybrid else 0], len(owners)
        for slot, layer in enumerate(owners):
            layer_slot[layer] = slot
    else:
        size = min(sum(windows[i] == k for i in owners) for k in kinds)
        group_windows = []
        for kind in kinds:
            layers = [i for i in owners if windows[i] == kind]
            for start in range(0, len(layers), size):
                for slot, layer in enumerate(layers[start:start + size]):
                    layer_group[layer], layer_slot[layer] = len(group_windows), slot
                group_windows.append(kind)
    for i in range(num_layers):
        layer_group[i], layer_slot[i] = layer_group[sources[i]], layer_slot[sources[i]]
    return KVLayout(tuple(group_windows), tuple(layer_group), tuple(layer_slot), size)


def model_layout(config: ModelConfig, max_model_len: int, hybrid: bool = True) -> KVLayout:
    """``kv_layout`` of a model's windows and cache sources."""
    return kv_layout(config.layer_windows, config.num_hidden_layers, max_model_len, hybrid, config.kv_sources)


def model_shapes(config: ModelConfig, tp_size: int = 1) -> list[tuple[int, int]]:
    """Each layer's cache ``(kv_heads, head_dim)`` on one of ``tp_size`` ranks (which
    caches its share of the KV heads)."""
    return [(config.layer_kv_heads(i) // tp_size, config.layer_head_dim(i)) for i in range(config.num_hidden_layers)]


def allocate_model(config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                   device: torch.device | str = "cpu", tp_size: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``allocate`` for a model with one block table for every layer (no hybrid groups)."""
    return allocate(model_layout(config, 0, hybrid=False), model_shapes(config, tp_size), num_blocks, block_size,
                    dtype, device)

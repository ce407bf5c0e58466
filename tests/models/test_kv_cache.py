"""The KV cache's storage (``models.kv_cache``): sizes, the int8 rows and the CPU allocation."""

from __future__ import annotations

import gc

import pytest
import torch

from models import kv_cache


def test_int8_rows_hold_the_codes_then_the_scale() -> None:
    x = torch.tensor([[0.5, -1.0, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0]])

    rows = kv_cache.to_cache_rows(x, torch.int8)

    assert rows.dtype == torch.int8 and rows.shape == (2, 4 + kv_cache.INT8_SCALE_BYTES)
    # max|x| = 1 -> codes x * 127, ties to even (0.5 * 127 = 63.5 -> 64, 0.25 * 127 = 31.75 -> 32).
    assert rows[0, :4].tolist() == [64, -127, 32, 0]
    assert rows[0, 4:].contiguous().view(torch.float32).item() == pytest.approx(1 / 127)
    assert rows[1].tolist() == [0] * 8  # an all-zero row: codes 0, scale 0.0


def test_int8_rows_round_trip_within_half_a_code() -> None:
    x = torch.randn(50, 3, 64, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, 50)[:, None, None]

    back = kv_cache.from_cache_rows(kv_cache.to_cache_rows(x, torch.int8), torch.float32)

    half_code = x.abs().amax(-1, keepdim=True) / 127 / 2
    assert back.shape == x.shape
    assert ((back - x).abs() <= half_code * (1 + 1e-5)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_float_rows_are_a_cast(dtype: torch.dtype) -> None:
    x = torch.randn(4, 2, 16)
    rows = kv_cache.to_cache_rows(x, dtype)
    assert rows.dtype == dtype and rows.shape == x.shape
    assert torch.equal(kv_cache.from_cache_rows(rows, torch.float32), x.to(dtype).float())


def test_sizes_per_dtype() -> None:
    # SmolLM2-135M: 30 layers, 3 KV heads of 64, blocks of 16 tokens.
    layout = kv_cache.kv_layout((), 30, 0)
    fp16 = kv_cache.block_bytes(layout, [(3, 64)] * 30, 16, torch.float16)
    int8 = kv_cache.block_bytes(layout, [(3, 64)] * 30, 16, torch.int8)
    assert fp16 == 2 * 30 * 16 * 3 * 64 * 2
    assert int8 == 2 * 30 * 16 * 3 * 68
    (k, v), = kv_cache.allocate(kv_cache.kv_layout((), 1, 0), [(3, 64)], 5, 16, torch.int8)
    assert k.shape == v.shape == (5, 16, 3, 68) and not k.any()
    assert kv_cache.row_width(64, torch.int8) == 68 and kv_cache.row_width(64, torch.float16) == 64


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.int8])
def test_cpu_caches_are_separate_zeroed_views_that_outlive_the_list(dtype: torch.dtype) -> None:
    layers, shape = 3, (5, 4, 2, kv_cache.row_width(8, dtype))
    caches = kv_cache.allocate(kv_cache.kv_layout((), layers, 0), [(2, 8)] * layers, 5, 4, dtype)
    assert len(caches) == layers
    tensors = [t for pair in caches for t in pair]
    for i, t in enumerate(tensors):
        # Head-major within a block: a head's rows of a block are one run of memory.
        assert t.shape == shape and t.dtype == dtype and t.transpose(1, 2).is_contiguous()
        assert t.stride() == (4 * 2 * shape[3], shape[3], 4 * shape[3], 1) and kv_cache.paged_layout(t)
        assert not t.any()
        t.fill_(i + 1)
    del caches
    gc.collect()
    # Each view kept its own values (no overlap) and the mapping under them is still alive.
    for i, t in enumerate(tensors):
        assert (t == i + 1).all()
    assert len({t.data_ptr() for t in tensors}) == 2 * layers


def test_layers_of_other_shapes_share_a_slot_without_overlapping() -> None:
    # Gemma 4's shape: windowed layers of 2 KV heads of 16 beside full ones of 1 head of 64;
    # the last two layers read layers 2 and 3's caches and hold none.
    windows, sources = (8, 0) * 3, (0, 1, 2, 3, 2, 3)
    shapes = [(2, 16), (1, 64)] * 3
    layout = kv_cache.kv_layout(windows, 6, 64, sources=sources)
    assert layout.group_windows == (0, 8) and layout.num_slots == 2
    assert layout.layer_group[4:] == layout.layer_group[2:4] and layout.layer_slot[4:] == layout.layer_slot[2:4]
    # A block id takes its slots' larger pages (the full layers' 4 tokens of 64), K and V.
    assert kv_cache.block_bytes(layout, shapes, 4, torch.float32) == 2 * 2 * 4 * 64 * 4
    caches = kv_cache.allocate(layout, shapes, 3, 4, torch.float32)
    assert [c[0].data_ptr() for c in caches[4:]] == [c[0].data_ptr() for c in caches[2:4]]  # the sources'
    (wk, wv), (fk, fv) = caches[0], caches[1]  # one slot: windowed layer 0, full layer 1
    assert wk.shape == (3, 4, 2, 16) and fk.shape == (3, 4, 1, 64) and wk.stride(0) == fk.stride(0) == 256
    assert not wk.is_contiguous() and all(kv_cache.paged_layout(t) for t in (wk, wv, fk, fv))
    # Block 1 of the windowed layer, block 2 of the full one (a block id is one group's at a
    # time): each write stays in its block id's bytes.
    wk[1].fill_(1.0)
    fk[2].fill_(2.0)
    assert (wk[1] == 1).all() and (fk[2] == 2).all() and not fk[0].any() and not wk[0].any()
    assert (wk[2] == 2).all()  # (the same bytes: block 2 is the full group's now)
    assert not wv.any() and not fv.any() and not caches[2][0].any()
    # Without hybrid groups every layer holding a cache has a slot of its own shape, packed.
    flat = kv_cache.kv_layout(windows, 6, 64, hybrid=False, sources=sources)
    assert flat.num_slots == 4 and flat.layer_slot == (0, 1, 2, 3, 2, 3)
    assert all(t.transpose(1, 2).is_contiguous() for pair in kv_cache.allocate(flat, shapes, 3, 4, torch.float16)
               for t in pair)


def test_the_kernels_packings_and_no_other_are_paged_layouts() -> None:
    token_major = torch.zeros(5, 4, 3, 8)
    head_major = torch.zeros(5, 3, 4, 8).transpose(1, 2)
    spaced = torch.zeros(5, 3 * 4 * 8 + 16)[:, :3 * 4 * 8].view(5, 3, 4, 8).transpose(1, 2)  # blocks further apart
    assert all(kv_cache.paged_layout(t) for t in (token_major, head_major, spaced))
    assert not kv_cache.paged_layout(torch.zeros(5, 8, 3, 4).transpose(1, 3))  # rows not contiguous
    assert not kv_cache.paged_layout(torch.zeros(4, 5, 3, 8).transpose(0, 1))  # blocks inside each other
    assert not kv_cache.paged_layout(torch.zeros(5, 4, 3, 16)[..., :8])  # gaps between rows


def test_huge_page_zeros_is_zeroed_and_writable() -> None:
    buf = kv_cache.huge_page_zeros(3 << 20)
    assert buf.dtype == torch.uint8 and buf.numel() == 3 << 20 and not buf.any()
    buf[-1] = 7
    assert int(buf.sum()) == 7


def _rss_anon() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


@pytest.mark.parametrize("advice", ["populate", "unknown to the kernel"])
def test_huge_page_zeros_holds_its_memory_from_the_start(monkeypatch: pytest.MonkeyPatch, advice: str) -> None:
    # The budget is claimed when the cache is made (a machine that cannot hold it fails at
    # start-up), by MADV_POPULATE_WRITE, or on a kernel that does not know it by writing zeros.
    if advice != "populate":
        monkeypatch.setattr(kv_cache, "_MADV_POPULATE_WRITE", 9999)  # EINVAL, as before Linux 5.14
        monkeypatch.delattr(kv_cache.mmap, "MADV_POPULATE_WRITE", raising=False)
    before = _rss_anon()
    buf = kv_cache.huge_page_zeros(64 << 20)
    assert _rss_anon() - before >= 60 << 20
    assert not buf[::4096].any()


@pytest.mark.parametrize("setting, model_dtype, expected", [
    ("auto", torch.float32, torch.float16), ("auto", torch.bfloat16, torch.bfloat16),
    ("float32", torch.float32, torch.float32), ("bfloat16", torch.float32, torch.bfloat16),
    ("int8", torch.float32, torch.int8), ("int8", torch.bfloat16, torch.int8),
])
def test_a_kv_cache_dtype_setting_resolves_against_the_model_dtype(setting, model_dtype, expected) -> None:
    assert kv_cache.resolve_dtype(setting, model_dtype) == expected

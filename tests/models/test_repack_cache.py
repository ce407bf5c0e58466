"""The repack cache: a GGUF file's repacked projections written on its first native start and
mapped on the next, the same bits either way; an entry made from another file or by other
formats is rebuilt, a damaged one too, and entries whose file is gone are deleted."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from gguf_files import MIXED_TYPES, write_mixed_gguf
from models import repack_cache
from models.gguf_linear import NativeA8Linear
from models.loader import load_model
from models.ops import build

PROMPT = torch.randint(256, (37,), generator=torch.Generator().manual_seed(5)).tolist()
TYPES = [MIXED_TYPES[0], {"attn_q": "Q5_K", "attn_k": "Q8_0", "attn_v": "Q5_0", "attn_output": "Q4_0",
                          "ffn_gate": "Q3_K", "ffn_up": "Q4_1", "ffn_down": "IQ4_NL"}]


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache folder that every file, however small, is cached in."""
    monkeypatch.setenv("KVSERVE_REPACK_CACHE", str(tmp_path / "repacked"))
    monkeypatch.setattr(repack_cache, "MIN_FILE_BYTES", 0)
    return tmp_path / "repacked"


def _load(path: Path, make_runner) -> tuple[torch.Tensor, list]:
    model = load_model(str(path), "float32", "cpu", quantization="w4a8").model
    runner = make_runner(model)
    projections = [m for m in model.modules() if isinstance(m, NativeA8Linear)]
    return runner.step([(runner.new_seq(len(PROMPT)), PROMPT)])[0], projections


def test_a_second_start_maps_what_the_first_repacked(cache_dir, tmp_path, make_runner, caplog):
    path = tmp_path / "qwen2.gguf"
    write_mixed_gguf(path, arch="qwen2", types=TYPES)
    built, _ = _load(path, make_runner)
    entries = list(cache_dir.glob("*.safetensors"))
    assert len(entries) == 1
    with caplog.at_level(logging.INFO, logger="models.loader"):
        mapped, projections = _load(path, make_runner)
    assert f"{len(projections)} projections mapped from {entries[0]}" in caplog.text  # (every one, the head too)
    assert torch.equal(mapped, built)
    # The engine sizes the KV cache from the memory available less the mapped weights.
    codes = sum(t.numel() * t.element_size() for p in projections for _, c, s in p.segments for t in (c, s))
    assert load_model(str(path), "float32", "cpu", quantization="w4a8").mapped_bytes == codes

    # The file changed (its modification time): rebuilt, and the entry replaced.
    os.utime(path, ns=(1, 1))
    caplog.clear()
    with caplog.at_level(logging.INFO):
        again, _ = _load(path, make_runner)
    assert "repack cache: wrote" in caplog.text and torch.equal(again, built)

    # A damaged entry is set aside with a warning and rebuilt.
    entries[0].write_bytes(entries[0].read_bytes()[:100])
    caplog.clear()
    with caplog.at_level(logging.INFO):
        again, _ = _load(path, make_runner)
    assert "ignoring the repack cache" in caplog.text and "repack cache: wrote" in caplog.text
    assert torch.equal(again, built)


def test_a_stale_entry_makes_room_for_its_replacement(cache_dir, tmp_path, make_runner, monkeypatch, caplog):
    path = tmp_path / "qwen2.gguf"
    write_mixed_gguf(path, arch="qwen2", types=TYPES)
    _load(path, make_runner)
    (entry,) = cache_dir.glob("*.safetensors")
    size = entry.stat().st_size
    data = size - 8 - int.from_bytes(entry.read_bytes()[:8], "little")  # (the tensors' bytes)
    os.utime(path, ns=(1, 1))  # (the entry is stale now)
    # The disk has room for the new entry (twice its tensors' bytes) only once the stale one is gone.
    free = {"bytes": 2 * data - 1}
    real_unlink = Path.unlink

    def unlink(self, missing_ok=False):
        if self == entry and self.exists():
            free["bytes"] += size
        real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)
    monkeypatch.setattr(repack_cache.shutil, "disk_usage", lambda root: type("U", (), {"free": free["bytes"]}))
    with caplog.at_level(logging.INFO):
        _load(path, make_runner)
    assert "repack cache: wrote" in caplog.text
    with repack_cache.safe_open(str(entry), framework="pt") as f:
        assert '"mtime_ns": "1"' in f.metadata()["key"]


def test_entries_of_files_that_are_gone_are_deleted(cache_dir, tmp_path, make_runner):
    old, new = tmp_path / "old.gguf", tmp_path / "new.gguf"
    write_mixed_gguf(old, arch="qwen2", types=TYPES)
    _load(old, make_runner)
    old.unlink()
    write_mixed_gguf(new, arch="qwen2", types=TYPES, seed=1)
    _load(new, make_runner)
    assert [p.name.split(".")[0] for p in cache_dir.glob("*.safetensors")] == ["new"]


def test_small_files_and_off_are_not_cached(tmp_path, monkeypatch, make_runner):
    path = tmp_path / "qwen2.gguf"
    write_mixed_gguf(path, arch="qwen2", types=TYPES)
    monkeypatch.setenv("KVSERVE_REPACK_CACHE", str(tmp_path / "repacked"))
    _load(path, make_runner)  # (under MIN_FILE_BYTES)
    monkeypatch.setattr(repack_cache, "MIN_FILE_BYTES", 0)
    monkeypatch.setenv("KVSERVE_REPACK_CACHE", "off")
    _load(path, make_runner)
    assert not (tmp_path / "repacked").exists()


class _Recorder:
    """A raw file that records each write asked of it (offset, length) and writes at most
    ``limit`` bytes a call (as a raw write may)."""

    def __init__(self, limit: int) -> None:
        self.data, self.writes, self.limit = bytearray(), [], limit

    def write(self, view: memoryview) -> int:
        self.writes.append((len(self.data), len(view)))
        self.data += view[:self.limit]
        return min(len(view), self.limit)


@pytest.mark.parametrize("limit", [1 << 40, 3_000_000])
@pytest.mark.parametrize("sizes", [[8, 100], [5_000_000], [1 << 20, 1 << 20, 3], [100, 4_194_304, 7, 2_097_151]])
def test_an_entry_is_written_in_whole_huge_pages_from_huge_page_boundaries(sizes, limit):
    # (the page cache holds what such writes make in 2 MiB folios, which a mapping maps whole)
    unit = repack_cache._HUGE_PAGE
    rng = torch.Generator().manual_seed(len(sizes))
    pieces = [torch.randint(256, (n,), dtype=torch.uint8, generator=rng) for n in sizes]
    out = _Recorder(limit)
    repack_cache._write_aligned(out, [memoryview(p.numpy()) for p in pieces])
    assert bytes(out.data) == b"".join(p.numpy().tobytes() for p in pieces)
    # Every write asked for but the last ends on a boundary, and starts on one unless it goes
    # on with the rest of a short write.
    for (offset, n), (after, _) in zip(out.writes, out.writes[1:]):
        assert n > 0 and (offset + n) % unit == 0 and after <= offset + n
        assert offset % unit == 0 or limit < 1 << 40


def test_an_entry_maps_as_it_was_written_and_copy_on_write(tmp_path):
    tensors = {"codes": torch.randint(256, (3, 70_001), dtype=torch.uint8), "scales": torch.randn(5, 16),
               "half": torch.randn(33).half(), "empty": torch.empty(0, 4), "ids": torch.arange(9)}
    path = tmp_path / "entry.safetensors"
    repack_cache._write_safetensors(path, tensors, {"key": "k"})
    metadata, mapped = repack_cache._map_safetensors(path)
    assert metadata == {"key": "k"}
    from safetensors.torch import load_file
    assert list(mapped) == list(tensors)
    for name, t in load_file(path).items():
        assert mapped[name].dtype == t.dtype and torch.equal(mapped[name], t) and torch.equal(t, tensors[name])
    before = path.read_bytes()
    mapped["scales"].zero_()  # (a private mapping: the file keeps its bytes)
    assert path.read_bytes() == before
    path.write_bytes(before[:-10])  # cut short: the header names bytes the file lacks
    with pytest.raises(ValueError, match="bytes"):
        repack_cache._map_safetensors(path)


def test_a_kernel_build_is_loaded_as_is_only_when_made_from_these_sources(tmp_path):
    name, flags = "kvserve_cpu_ops_test", ["-O3"]
    assert build._load_built(name, tmp_path, flags) is None  # nothing built
    (tmp_path / f"{name}.so").write_bytes(b"not a library")
    (tmp_path / build._BUILT_FROM).write_text("another digest -O3")
    assert build._load_built(name, tmp_path, flags) is None  # built from other sources: rebuilt

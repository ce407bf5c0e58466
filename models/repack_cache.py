"""A GGUF file's repacked projections, kept on disk between starts.

Keeping a file's codes on the native paths (``w4a8``, ``w4a16``) repacks every projection
into the kernels' tile formats and checks each group's scale against the type's
dequantisation: about 1 s for a 1.5B Q4_K_M file on two cores, longer than the rest of a
start. The first start writes what it made to a safetensors file beside the fetched models
(``$KVSERVE_REPACK_CACHE``, default ``~/.cache/kvserve/repacked``; ``off``: never); a
later start of the same file maps it instead (no copy: the tensors are views of the
mapping). The entry is written in 2 MiB-aligned pieces and mapped with ``MADV_HUGEPAGE``,
so that the page cache holds it in 2 MiB folios and the kernel maps them whole (see
``_write_safetensors``). An entry is used only if it was made from this file (path, size, modification
time) by these formats (the kernels' sources, the packing code, the path); any other is
rebuilt and replaced (deleted first, so that its room counts for the new one). Entries
whose file is gone are deleted when another is written.
Files under ``MIN_FILE_BYTES`` (128 MiB) are not cached: they repack in a fraction of a second.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import mmap
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from models.gguf_linear import NativeA8Linear, NativeLinear

logger = logging.getLogger(__name__)

MIN_FILE_BYTES = 128 << 20
# The Python that decides a projection's formats and layout, beside the kernels' sources.
_PACKING = [Path(__file__).parent / name for name in ("gguf_linear.py", "gguf_native.py", "gguf_quants.py",
                                                      "moe_loader.py")]


def cache_directory() -> Path | None:
    """``$KVSERVE_REPACK_CACHE`` or ``~/.cache/kvserve/repacked``; None when it is ``off``."""
    setting = os.environ.get("KVSERVE_REPACK_CACHE", str(Path.home() / ".cache" / "kvserve" / "repacked"))
    return None if setting.lower() in ("off", "0", "") else Path(setting)


def _key(model: Path, path: str, folded: bool) -> dict[str, str]:
    from models.ops.build import sources_digest

    stat = model.stat()
    packing = hashlib.sha256(b"".join(p.read_bytes() for p in _PACKING)).hexdigest()[:12]
    return {"file": str(model), "size": str(stat.st_size), "mtime_ns": str(stat.st_mtime_ns),
            "formats": f"{sources_digest()}-{packing}", "path": path, "folded": str(folded)}


class RepackCache:
    """One file's projections on one path (``w4a8`` or ``w4a16``): from the disk where an
    entry matches, else built and kept for ``save``."""

    def __init__(self, model: Path, path: str, folded: bool) -> None:
        root = cache_directory()
        model = model.resolve()
        self.enabled = root is not None and model.stat().st_size >= MIN_FILE_BYTES
        self.key = _key(model, path, folded) if self.enabled else {}
        digest = hashlib.sha256(f"{model}\0{path}".encode()).hexdigest()[:16]
        self.file = (root or Path()) / f"{model.stem}.{path}.{digest}.safetensors"
        self.stored: dict[str, torch.Tensor] = {}
        self.layouts: dict[str, dict] = {}
        self.built: dict[str, torch.Tensor] = {}
        self.hits = self.misses = 0
        self.mapped_bytes = 0  # of the projections mapped from the entry
        if self.enabled and self.file.is_file():
            self._open()

    def _open(self) -> None:
        try:
            meta, stored = _map_safetensors(self.file)
            if json.loads(meta.get("key", "{}")) != self.key:
                return
            self.layouts, self.stored = json.loads(meta["layouts"]), stored
        except Exception as exc:  # a damaged entry: rebuilt and replaced
            logger.warning("ignoring the repack cache %s (%s)", self.file, exc)
            self.layouts, self.stored = {}, {}

    def projection(self, name: str, bias: bool, build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
        """Projection ``name`` (a ``NativeLinear`` or ``NativeA8Linear``) from the cache, else
        ``build()``'s (any module; only the native ones are kept)."""
        layout = self.layouts.get(name)
        if layout is not None:
            self.hits += 1
            cls = NativeA8Linear if layout["a8"] else NativeLinear
            segments = [(fmt, self.stored[f"{name}.{i}.codes"], self.stored[f"{name}.{i}.scales"])
                        for i, fmt in enumerate(layout["formats"])]
            self.mapped_bytes += sum(t.numel() * t.element_size() for _, c, s in segments for t in (c, s))
            return cls(segments, layout["in"], layout["out"], bias)
        self.misses += 1
        module = build()
        if self.enabled and isinstance(module, NativeLinear):
            self.layouts[name] = {"a8": isinstance(module, NativeA8Linear), "formats": module.formats,
                                  "in": module.in_features, "out": module.out_features}
            for i, (_, codes, scales) in enumerate(module.segments):
                self.built[f"{name}.{i}.codes"], self.built[f"{name}.{i}.scales"] = codes, scales
        return module

    def save(self) -> None:
        """Write the projections built this start (with those read) where any was built."""
        if not (self.enabled and self.misses and self.built):
            return
        tensors = {**self.stored, **self.built}
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        root = self.file.parent
        root.mkdir(parents=True, exist_ok=True)
        _prune(root)
        if not self.stored:
            # NOTE: an entry of this file left by other formats or damaged is never read again,
            # and its room is the replacement's: on a full disk, keeping it until the new one
            # was written left a stale 9.5 GB entry and every later start repacking.
            self.file.unlink(missing_ok=True)
        if shutil.disk_usage(root).free < 2 * size:
            logger.info("repack cache: %.1f GB would not leave room on %s; not written", size / 1e9, root)
            return
        tmp = self.file.with_suffix(f".{os.getpid()}.tmp")
        meta = {"key": json.dumps(self.key), "layouts": json.dumps(self.layouts)}
        try:
            _write_safetensors(tmp, tensors, meta)
            os.replace(tmp, self.file)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            logger.warning("repack cache: could not write %s (%s)", self.file, exc)
            return
        logger.info("repack cache: wrote %s (%.2f GB): later starts of this file map it", self.file, size / 1e9)


_DTYPES = {torch.uint8: "U8", torch.int8: "I8", torch.float32: "F32", torch.int32: "I32", torch.float16: "F16",
           torch.bfloat16: "BF16", torch.int16: "I16", torch.int64: "I64"}


# A PMD mapping's size on x86-64 and arm64 with 4 KB pages: the unit in which the page cache
# holds the entry and the kernel maps it, when both can.
_HUGE_PAGE = 2 << 20


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """A safetensors file of ``tensors``, written from their memory as it is (``save_file``
    copies every tensor to bytes first: 1.7 s where this takes a fraction of it for 1 GB).

    Every write but the last covers whole 2 MiB pieces from a 2 MiB boundary: the page cache
    then holds the file in 2 MiB folios (ext4, Linux 6.18), which a mapping of it maps with
    2 MiB pages. Written tensor by tensor as they are packed, it held small folios and was
    mapped 4 KB at a time: OLMoE's shape decoded a token in 32.0-33.0 ms against 30.2-31.7 ms
    (the same entry rewritten by 4 KB and by 2 MiB writes, alternated twice; AVX2 EPYC)."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # (the data starts 8-byte aligned)
    with open(path, "wb", buffering=0) as out:
        _write_aligned(out, [memoryview(len(text).to_bytes(8, "little") + text)]
                      + [memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()) for t in tensors.values()])


def _write_aligned(out, pieces: list[memoryview], unit: int = _HUGE_PAGE) -> None:
    """``pieces`` (flat byte views) one after another to the raw file ``out``, from its start, in writes of whole
    ``unit``-sized pieces at ``unit`` boundaries but the last: a piece's part that does not fill
    a unit waits in a buffer for the next piece's bytes; whole units go from the piece as it is."""
    buffer, filled = bytearray(unit), 0

    def write(view: memoryview) -> None:
        while view:
            view = view[out.write(view):]

    for piece in pieces:
        if filled:
            take = min(unit - filled, len(piece))
            buffer[filled:filled + take] = piece[:take]
            filled, piece = filled + take, piece[take:]
            if filled < unit:
                continue
            write(memoryview(buffer))
            filled = 0
        whole = len(piece) - len(piece) % unit
        write(piece[:whole])
        buffer[:len(piece) - whole] = piece[whole:]
        filled = len(piece) - whole
    write(memoryview(buffer)[:filled])


_FROM_NAME = {name: dtype for dtype, name in _DTYPES.items()}


def _map_safetensors(path: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """The metadata and tensors of a safetensors file ``_write_safetensors`` wrote, the tensors
    as views of one private mapping of it (copy-on-write: a write to a view never reaches the
    file), advised ``MADV_HUGEPAGE`` before any page is read, so that what is read from the
    disk again (the first start after the entry left the page cache) comes in 2 MiB folios
    mapped whole. A header that does not describe the file raises ValueError."""
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # (Linux)
        mapping.madvise(mmap.MADV_HUGEPAGE)
    length = int.from_bytes(mapping[:8], "little")
    if 8 + length > len(mapping):
        raise ValueError(f"a header of {length} bytes in a file of {len(mapping)}")
    header = json.loads(mapping[8:8 + length])
    metadata = header.pop("__metadata__", None) or {}
    start, tensors = 8 + length, {}
    for name, info in header.items():
        dtype, shape, (lo, hi) = _FROM_NAME[info["dtype"]], info["shape"], info["data_offsets"]
        count = math.prod(shape)
        if not (0 <= lo <= hi <= len(mapping) - start and hi - lo == count * dtype.itemsize):
            raise ValueError(f"tensor {name}: bytes {lo}-{hi} for {shape} {dtype} in a file of {len(mapping)}")
        tensors[name] = (torch.frombuffer(mapping, dtype=dtype, count=count, offset=start + lo).view(shape)
                         if count else torch.empty(shape, dtype=dtype))
    return metadata, tensors


def _prune(root: Path) -> None:
    """Delete the entries whose model file is gone (a temporary or moved file's)."""
    for entry in root.glob("*.safetensors"):
        try:
            with safe_open(str(entry), framework="pt") as f:
                source = json.loads((f.metadata() or {}).get("key", "{}")).get("file")
        except Exception:  # (a damaged entry: deleted)
            source = None
        if source is None or not Path(source).exists():
            entry.unlink(missing_ok=True)

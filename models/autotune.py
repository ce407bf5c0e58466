"""Which activation dtype and quantization run fastest here: measured, not guessed.

``--dtype auto`` and ``--quantization auto`` on a CPU leave the choice to this
module. CPU flags say what *can* run (bfloat16 at full speed needs AVX512-BF16
or AMX, w4a8 vector integer dots: AVX2 or AVX-512, w4a16 AMX-BF16); they do not say what is
fastest: on a Sapphire Rapids core bfloat16 activations took 1.6-1.9x longer than float32 ones with the same
4-bit weights. So each candidate runs a model with the real one's shapes
(random weights, ``PROBE_LAYERS`` layers and the LM head) for a decode step
of ``DECODE_SEQS`` sequences, one of ``FULL_BATCH_SEQS`` (a server's batch under
load: the paths' order can differ there) and a prompt chunk of ``PROMPT_TOKENS``
tokens; the fastest by the product of the three times, each relative to the
best, wins. The candidates are timed in rounds (``measure_all``), so that another
process's burst on a shared machine falls on all of them alike, and each time is
the fastest of its rounds (a disturbance only adds time). The choice is kept in the kernel cache (one per CPU and torch build, see
``ops.cache_directory``) with the times, and logged with them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from models import kv_cache, ops
from models.attention import SeqSpec, build_attention_metadata
from models.config import ModelConfig
from models.fused import fused_part_sizes
from models.gguf_loader import FOUR_BIT_TYPES
from models.gguf_linear import A8_TYPE_FORMATS
from models.gguf_native import KINDS, PROJECTIONS, FileTypes, random_projection
from models.quant import prepare_projections
from models.registry import model_class

logger = logging.getLogger(__name__)

PROBE_LAYERS = 4  # enough distinct layers that their weights do not all stay in cache
DECODE_SEQS = 16
# The engine's default step of sequences on a CPU (engine.config's max_num_seqs). At 64
# rows float32 + w4a8 on AMX-INT8 took 2.2x w4a16's time per decode step, at 16 1.3x.
FULL_BATCH_SEQS = 64
DECODE_CONTEXT = 256
PROMPT_TOKENS = 256  # the engine's default step budget on a CPU (engine.config.CPU_BUDGET)
RUNS = 5
BLOCK_SIZE = 16
CACHE_FILE = "paths.json"
# Part of the cache key, with a digest of the kernels' sources: bump it when a
# path's Python side changes what it runs, so the choice is measured again.
# 2: int4 runs the grouped kernel for every batch, none the dense one.
# 3: the prompt chunk is 256 tokens, the engine's step budget since it went down from 512.
# 4: the candidates are timed in rounds (measure_all), not one after another.
# 5: w4a16 (4-bit weights on AMX-BF16 tiles) is a candidate where the CPU has AMX-BF16.
# 6: a decode of FULL_BATCH_SEQS is timed too, and each time is the fastest round's.
# 7: w4a16 on a GGUF file is timed on the file's own types, its 4-bit tensors as 4-bit codes.
# 8: a GGUF file's codes of up to 7 bits run folded (scales after each block's tile product).
# 9: folding is opt-in (KVSERVE_GGUF_FOLD=1, in the file types' key); scaled operands again by default.
# 10: w4a8 on a GGUF file keeps each tensor at its type (gguf_native.a8_projection), a candidate
#     for any file whose types its formats hold.
PATHS_VERSION = 10


@dataclass(frozen=True)
class RunPath:
    """One way to run the model: activation dtype and quantization method."""

    dtype: str  # "float32" | "bfloat16"
    quantization: str  # "none" | "int4" | "w4a8" | "w4a16"
    amx: bool = False  # w4a8's integer dots on AMX tiles instead of VNNI (equal results)

    def __str__(self) -> str:
        return f"{self.dtype} + {self.quantization}" + (" on AMX" if self.amx else "")


@dataclass(frozen=True)
class Timing:
    """Estimated whole-model milliseconds of one candidate (``PROBE_LAYERS`` scaled up)."""

    path: RunPath
    decode_ms: float  # a decode step of DECODE_SEQS sequences
    prompt_ms: float  # a prompt chunk of PROMPT_TOKENS tokens
    full_batch_ms: float  # a decode step of FULL_BATCH_SEQS sequences


def candidates(dtype: str, quantization: str, four_bit: bool, native: bool = False,
               native_a8: bool = False) -> list[RunPath]:
    """The paths this CPU can run, within what the settings leave open.

    ``four_bit``: the checkpoint's projections are 4-bit (their codes can be
    kept); ``native``: a GGUF file whose projections ``w4a16`` keeps at their own
    types (``models.gguf_native``), ``native_a8``: one whose types ``w4a8`` keeps
    (then ``none``, a float copy, is no candidate); otherwise only ``none`` is a
    quantization to consider.
    """
    dtypes = [dtype] if dtype != "auto" else ["float32"] + (["bfloat16"] if cpu_has_native_bf16() else [])
    int8_dots = ops.kernels_enabled(torch.device("cpu")) and ops.has_int8_dots()
    if quantization != "auto":
        quants = [quantization]
    elif four_bit:
        quants = (["w4a8"] if int8_dots else []) + ["int4", "none"]
    elif native_a8 and int8_dots:
        # The file's own codes, exact at their bits: no float copy of every projection (4-8x the
        # memory, and as many more bytes a one-stream decode reads), however the batch and prompt
        # probes time it (on an AVX2 CPU float32 GEMMs took an IQ4_XS 1.5B at 160 ms a token
        # where w4a8 takes 53). ``--quantization none`` still asks for one.
        quants = ["w4a8"]
    else:
        quants = ["none"]
    paths = [RunPath(d, q) for d in dtypes for q in quants]
    if native_a8 and not four_bit and quantization == "auto":
        # a file's own codes on w4a8 take float32 x either way, and have no AMX-INT8 kernel
        paths = [p for p in paths if p != RunPath("bfloat16", "w4a8")]
    mode = ops.amx_mode()
    if mode == "force" and not ops.amx_usable():
        logger.warning("KVSERVE_AMX=force: AMX-INT8 is not usable here (no AMX, or the self-check "
                       "failed: see python -m models.ops), so w4a8 runs on VNNI")
    elif mode == "force":
        paths = [RunPath(p.dtype, p.quantization, amx=p.quantization == "w4a8") for p in paths]
    elif ops.amx_usable() and len(paths) > 1 and (four_bit or quantization != "auto"):
        paths += [RunPath(p.dtype, p.quantization, amx=True) for p in paths if p.quantization == "w4a8"]
    if mode == "auto" and quantization == "auto" and (four_bit or native) and "float32" in dtypes \
            and ops.amx_bf16_usable():
        # The 4-bit weights on AMX-BF16 tiles (float32 activations only), its LM head too:
        # the AMX-INT8 switch (``amx``) does not touch it.
        paths.append(RunPath("float32", "w4a16"))
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
           cache_dir: Path | None = None, measure_again: bool = False, types: FileTypes | None = None) -> RunPath:
    """The fastest path for ``config`` on this CPU: from the cache, else measured.

    ``dtype``/``quantization`` are the settings ("auto" leaves them open).
    ``measure_again``: measure even when the cache holds a choice, and replace it
    (for a choice made while the machine was busy). ``types``: a GGUF file's
    projection types, which ``w4a16`` keeps (its probe is made of them).
    """
    # (w4a8 keeps a file's types where their formats hold them and every weight is whole 16-row tiles)
    rows = (*fused_part_sizes("qkv_proj", config), config.hidden_size, config.intermediate_size, config.vocab_size)
    native_a8 = types is not None and types.a8() and all(n % 16 == 0 for n in rows)
    options = candidates(dtype, quantization, four_bit, native=types is not None, native_a8=native_a8)
    if len(options) == 1:
        return options[0]
    cache_dir = cache_dir if cache_dir is not None else ops.cache_directory()
    key = _cache_key(config, options) + (f" | {types.key()}" if types is not None else "")
    cached = None if measure_again else _read_cache(cache_dir).get(key)
    if cached is not None and RunPath(**cached["path"]) in options:
        path = RunPath(**cached["path"])
        logger.info("path auto: %s (measured earlier on this CPU; %s)", path, cached["why"])
        return path
    timings = measure_all(config, options, types=types)
    best, why = pick(timings)
    logger.info("path auto: %s (%s)", best.path, why)
    _write_cache(cache_dir, key, {"path": dataclasses.asdict(best.path), "why": why,
                                  "timings": [_timing_json(t) for t in timings]})
    return best.path


def pick(timings: list[Timing]) -> tuple[Timing, str]:
    """The timing with the smallest product of its three times (decode, full-batch
    decode, prompt), each relative to the best of its kind; and a line that says why."""
    best_decode = min(t.decode_ms for t in timings)
    best_full = min(t.full_batch_ms for t in timings)
    best_prompt = min(t.prompt_ms for t in timings)

    def score(t: Timing) -> float:
        return (t.decode_ms / best_decode) * (t.full_batch_ms / best_full) * (t.prompt_ms / best_prompt)

    ranked = sorted(timings, key=score)
    why = "; ".join(f"{t.path}: decode of {DECODE_SEQS} {t.decode_ms:.1f} ms, of {FULL_BATCH_SEQS} "
                    f"{t.full_batch_ms:.1f} ms, prompt of {PROMPT_TOKENS} {t.prompt_ms:.1f} ms" for t in ranked)
    return ranked[0], f"estimated whole-model steps, fastest first: {why}"


def measure(config: ModelConfig, path: RunPath, runs: int = RUNS) -> Timing:
    """Time ``path`` on a random-weight model of ``config``'s shapes (see the module doc)."""
    return measure_all(config, [path], runs)[0]


def measure_all(config: ModelConfig, paths: list[RunPath], runs: int = RUNS,
                types: FileTypes | None = None) -> list[Timing]:
    """Time every path in ``paths`` (as :func:`measure`), in ``runs`` rounds that each time
    every path once; each time is the fastest over the rounds.

    Why rounds: these machines are shared, and one path timed after another can
    meet another process's burst or a slower phase (up to 1.8x within minutes)
    that the other path missed; a choice made from that is cached for good. In
    rounds, such a disturbance falls on every path alike. Why the fastest round:
    a disturbance only adds time. With the median, one start had three of five
    rounds of w4a16 disturbed (its prompt 217 ms against 85-112 in every other
    measurement here) and cached float32 + w4a8 on AMX, whose 64-sequence decode
    step takes 2.2x w4a16's.
    """
    caches: dict[torch.dtype, list] = {}  # one cache per KV dtype, shared by the probes
    probes = [_Probe(config, p, caches, types) for p in paths]
    for probe in probes:
        probe.run(record=False)  # warm: first-call allocations, lazily built state
    for _ in range(runs):
        for probe in probes:
            probe.run(record=True)
    return [probe.timing() for probe in probes]


class _Probe:
    """One path's probe model (``PROBE_LAYERS`` layers and the head, random weights) with
    the inputs of decode steps of DECODE_SEQS and FULL_BATCH_SEQS sequences and of a prompt
    chunk, and its times so far."""

    def __init__(self, config: ModelConfig, path: RunPath, caches: dict[torch.dtype, list] | None = None,
                 types: FileTypes | None = None) -> None:
        """``caches``: KV caches by dtype that probes may share (what they hold does not
        matter to a timing; a cache each would hold the nine candidates' ~50 MB each at once).
        ``types``: the file's projection types, of which a ``w4a16`` probe is made."""
        self.config, self.path = config, path
        self.layers = min(PROBE_LAYERS, config.num_hidden_layers)
        probe = dataclasses.replace(config, num_hidden_layers=self.layers, layer_windows=config.layer_windows[:self.layers])
        self.model = _probe_model(probe, path, types)
        kv_dtype = kv_cache.default_dtype(getattr(torch, path.dtype))
        decode_blocks = kv_cache.cdiv(DECODE_CONTEXT + 1, BLOCK_SIZE)
        prompt_blocks = kv_cache.cdiv(PROMPT_TOKENS, BLOCK_SIZE)
        # The decode of DECODE_SEQS reads the first of the FULL_BATCH_SEQS sequences' blocks.
        num_blocks = FULL_BATCH_SEQS * decode_blocks + prompt_blocks
        shape = (num_blocks, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
        caches = {} if caches is None else caches
        if kv_dtype not in caches:
            caches[kv_dtype] = [tuple(kv_cache.to_cache_rows(torch.randn(shape), kv_dtype) for _ in range(2))
                                for _ in range(self.layers)]
        self.caches = caches[kv_dtype]
        order = list(range(num_blocks))
        random.Random(0).shuffle(order)  # a cache in use is scattered
        tables = [order[i * decode_blocks:(i + 1) * decode_blocks] for i in range(FULL_BATCH_SEQS)]
        self.decode = {n: build_attention_metadata([SeqSpec(1, DECODE_CONTEXT + 1, t) for t in tables[:n]],
                                                   BLOCK_SIZE) for n in (DECODE_SEQS, FULL_BATCH_SEQS)}
        self.prompt = build_attention_metadata(
            [SeqSpec(PROMPT_TOKENS, PROMPT_TOKENS, order[-prompt_blocks:])], BLOCK_SIZE)
        self.decode_ids = torch.randint(config.vocab_size, (FULL_BATCH_SEQS,))
        self.prompt_ids = torch.randint(config.vocab_size, (PROMPT_TOKENS,))
        dtype = getattr(torch, path.dtype)
        self.head_rows = {n: torch.randn(n, config.hidden_size).to(dtype) for n in (DECODE_SEQS, FULL_BATCH_SEQS, 1)}
        self.times: dict[str, list[float]] = {name: [] for name in (
            "decode", "full_batch", "prompt", "head_decode", "head_full_batch", "head_prompt")}

    def _decode(self, n: int) -> torch.Tensor:
        return self.model(self.decode_ids[:n], torch.full((n,), DECODE_CONTEXT), self.decode[n], self.caches)

    def run(self, record: bool) -> None:
        """Each of the six measured calls once (its times kept when ``record``)."""
        calls = {
            "head_decode": lambda: self.model.lm_head(self.head_rows[DECODE_SEQS]),
            "head_full_batch": lambda: self.model.lm_head(self.head_rows[FULL_BATCH_SEQS]),
            "head_prompt": lambda: self.model.lm_head(self.head_rows[1]),
            "decode": lambda: self._decode(DECODE_SEQS),
            "full_batch": lambda: self._decode(FULL_BATCH_SEQS),
            "prompt": lambda: self.model(self.prompt_ids, torch.arange(PROMPT_TOKENS), self.prompt,
                                         self.caches, logits_indices=torch.tensor([PROMPT_TOKENS - 1])),
        }
        was_amx = ops.amx_enabled()
        ops.set_amx_enabled(self.path.amx)
        try:
            with torch.inference_mode():
                for name, fn in calls.items():
                    t0 = time.perf_counter()
                    fn()
                    if record:
                        self.times[name].append((time.perf_counter() - t0) * 1e3)
        finally:
            ops.set_amx_enabled(was_amx)

    def timing(self) -> Timing:
        """Whole-model estimates from the fastest of the recorded times."""
        best = {name: min(t) for name, t in self.times.items()}
        n = self.config.num_hidden_layers
        return Timing(self.path, _scaled(best["decode"], best["head_decode"], self.layers, n),
                      _scaled(best["prompt"], best["head_prompt"], self.layers, n),
                      _scaled(best["full_batch"], best["head_full_batch"], self.layers, n))


def _probe_model(config: ModelConfig, path: RunPath, types: FileTypes | None = None) -> torch.nn.Module:
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
    if path.quantization in ("w4a16", "w4a8") and types is not None and (path.quantization == "w4a16" or types.a8()):
        _native_projections(model, config, types, a8=path.quantization == "w4a8")
    else:
        prepare_projections(model, path.quantization)
    return model.eval()


def _native_projections(model: torch.nn.Module, config: ModelConfig, types: FileTypes, a8: bool = False) -> None:
    """The probe's projections and head as ``w4a16`` (``a8``: ``w4a8``) loads the file's: random
    blocks of its types, the layers' taken from layers spread over the file."""
    for i, (layer, layer_types) in enumerate(zip(model.model.layers, types.sample(len(model.model.layers)))):
        by_kind = dict(zip(KINDS, layer_types))
        for (block, name), kinds in PROJECTIONS.items():
            old = getattr(getattr(layer, block), name)
            shapes = [(rows, old.in_features) for rows in fused_part_sizes(name, config)]
            proj = random_projection(kinds, tuple(by_kind[k] for k in kinds), shapes, seed=i,
                                     bias=old.bias is not None, a8=a8)
            if old.bias is not None:
                proj.bias.copy_(old.bias.detach().float())
            setattr(getattr(layer, block), name, proj)
    head = types.head if not a8 or types.head in A8_TYPE_FORMATS else "Q8_0"  # (w4a8's head of a float one: int8)
    model.lm_head = random_projection(("output",), (head,), [(config.vocab_size, config.hidden_size)], seed=99,
                                      a8=a8)


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
    return {"path": str(t.path), "decode_ms": round(t.decode_ms, 3), "prompt_ms": round(t.prompt_ms, 3),
            "full_batch_ms": round(t.full_batch_ms, 3)}


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

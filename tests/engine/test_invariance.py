"""Same request, same answer: logprobs bit for bit however a request was computed.

For each path ``--dtype auto`` / ``--quantization auto`` can pick (float32 or
bfloat16 activations; w4a8, int4 or no quantization; float32, float16,
bfloat16 or int8 KV caches), a table of prompts runs cold (alone, in one
prefill) and then: again after a prefix cache hit (of every prompt, and of
one block of a longer one), in chunks of 16 and of 48 tokens, inside a batch
of 16 requests arriving over time (prompts beside decodes), and through a KV
cache so small that requests are preempted and recomputed. Every generated
token's logprob must be equal, bit for bit, to the cold run's, and so must the
tokens and texts. Nothing is compared with a tolerance: an optimisation never
changes a result. A model with a sliding-window layer beside a full one (a hybrid
KV cache whose windowed group gives back the blocks its window left) keeps the
same guarantee, and equals its run with every block kept.
"""

from __future__ import annotations

import dataclasses
import gc
from dataclasses import dataclass, field

import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_runner import kv_bytes_per_block
from engine.sampling_params import SamplingParams
from models import ops
from models.kv_cache import model_layout
from models.loader import load_model
from models.quant import QuantizedLinear

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16
MAX_MODEL_LEN = 384
MAX_TOKENS = 5
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)

LONG_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
    "metal type, oil-based ink and a wooden screw press adapted from wine making. Before his workshop in Mainz, "
    "books were copied by hand in monasteries, which made them rare and expensive. Within fifty years presses had "
    "spread to more than two hundred cities across Europe, and millions of books were printed. Historians often "
    "say that this change helped the Reformation, the scientific revolution and the growth of literacy. Printers "
    "became publishers, editors and booksellers at once; they chose which texts were worth the cost of paper, "
    "standardised spelling to sell across regions, and added title pages, page numbers and indexes so that readers "
    "could find their way. Pamphlets carried news and arguments faster than any preacher could travel, and "
    "governments soon learned to license presses, censor books and print their own proclamations. Scholars could "
    "compare identical copies of a text for the first time, which made errors easier to correct and discoveries "
    "easier to build on. Maps, musical scores and "
    "diagrams could be reproduced without the slow drift of hand copying, so sailors, musicians and engineers "
    "shared the same references across borders. Local languages gained printed grammars and dictionaries, while "
    "Latin slowly lost its place as the only language of learning. Cheap almanacs taught farmers about weather "
    "and planting, and school primers put the alphabet into the hands of children whose parents had never owned "
    "a book. Within two centuries the "
    "newspaper, the scientific journal and the public library had all grown from the same small machine. In one "
    "sentence, the main effect of the press was"
)
FILLERS = ["Hello", "The capital of France is", "1, 2, 3, 4,", "Once upon a time", "Water boils at",
           "The opposite of hot is", "My favourite colour is", "def add(a, b):", "The sun rises in the",
           "Q: What is 7 times 8?\nA:", "Roses are red,", "A recipe for soup:"]

# (dtype, quantization, KV cache dtype): the loaded model is shared by the modes of one (dtype, quantization).
MODES = [
    ("float32", "w4a8", "float16"),
    ("float32", "w4a8", "float16", "amx"),  # grouped int8 projections on AMX tiles from 16 rows, VNNI below
    ("float32", "w4a8", "bfloat16"),
    ("float32", "w4a8", "int8"),
    ("float32", "amx-bf16", "float16"),  # only where the CPU has AMX-BF16 (no exact emulation)
    ("float32", "w4a16", "float16"),  # likewise
    ("float32", "int4", "float16"),
    ("float32", "none", "float32"),
    ("float32", "none", "float16"),
    ("bfloat16", "w4a8", "bfloat16"),
    ("bfloat16", "int4", "bfloat16"),
    ("bfloat16", "none", "bfloat16"),
]


@dataclass
class Generated:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    num_cached_tokens: int = 0


_loaded: dict[tuple[str, str, str], object] = {}
# The default model, and a Qwen2.5-shaped one (biases, 2 KV heads of 128 dimensions) whose
# tensors are of many GGUF types (tests/models/gguf_files.py), with the default model's vocabulary.
MODELS = ["smollm2", "qwen2-mixed"]


@pytest.fixture(scope="module")
def model_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from gguf_files import write_mixed_gguf

    from models.gguf_reader import read_gguf
    from models.loader import resolve_model_path

    fields = {k: v for k, v in read_gguf(resolve_model_path("smollm2")).fields.items() if k.startswith("tokenizer.")}
    path = tmp_path_factory.mktemp("invariance") / "qwen2-mixed.gguf"
    write_mixed_gguf(path, tokenizer_fields=fields)
    return {"smollm2": "smollm2", "qwen2-mixed": str(path), WINDOWED: f"{path}+window"}


# The Qwen2-shaped model's second layer sees the last WINDOW positions (as Qwen2's
# use_sliding_window from max_window_layers=1): the table's long prompts cross many windows.
WINDOW = 24
WINDOWED = "qwen2-mixed+window"


def loaded_model(model: str, dtype: str, quantization: str):
    """One loaded model at a time (each is a few hundred MB)."""
    key = (model, dtype, quantization)
    if key not in _loaded:
        _loaded.clear()
        gc.collect()
        path, _, window = model.partition("+")
        loaded = load_model(path, dtype=dtype, device="cpu", max_positions=MAX_MODEL_LEN, quantization=quantization)
        if window:
            config = dataclasses.replace(loaded.config, layer_windows=(0, WINDOW))
            loaded.model.model.layers[1].self_attn.window = WINDOW
            loaded.model.config = config
            loaded = dataclasses.replace(loaded, config=config)
        _loaded[key] = loaded
    return _loaded[key]


def make_engine(model: str, mode, num_blocks: int = 128, **overrides) -> LLMEngine:
    dtype, quantization, kv_dtype = mode[:3]
    loaded = loaded_model(model, dtype, quantization)
    import torch

    cfg = loaded.config
    layout = model_layout(cfg, MAX_MODEL_LEN, overrides.get("hybrid_kv_cache", True))
    budget = num_blocks * kv_bytes_per_block(cfg, getattr(torch, kv_dtype), BLOCK_SIZE, layout=layout)
    settings = dict(dtype=dtype, device="cpu", kv_cache_memory=budget, block_size=BLOCK_SIZE,
                    max_model_len=MAX_MODEL_LEN, kv_cache_dtype=kv_dtype, quantization=quantization,
                    max_num_batched_tokens=MAX_MODEL_LEN)
    settings.update(overrides)
    engine = LLMEngine(EngineConfig(**settings), loaded=loaded)
    assert engine.num_blocks == num_blocks
    return engine


def run(engine: LLMEngine, prompts: dict[str, list[int]], arrivals: dict[str, int] | None = None
        ) -> dict[str, Generated]:
    """Run ``prompts`` to the end; ``arrivals`` delays a request's arrival by that many steps."""
    arrivals = arrivals or {}
    results = {rid: Generated() for rid in prompts}
    step = 0
    pending = dict(prompts)
    while pending or engine.has_unfinished_requests():
        for rid in [r for r in pending if arrivals.get(r, 0) <= step]:
            engine.add_request(rid, pending.pop(rid), PARAMS)
        for out in engine.step():
            assert out.error is None
            got = results[out.request_id]
            got.num_cached_tokens = out.num_cached_tokens
            for o in out.outputs:
                got.token_ids += o.token_ids
                got.logprobs += [lp.logprob for lp in o.logprobs or []]
                got.text += o.text
        step += 1
    assert engine.kv_cache.stats.num_blocks_used == 0 or engine.config.enable_prefix_caching
    return results


def table(tokenizer) -> dict[str, list[int]]:
    """Short, crossing block boundaries, a chat template, and over 300 tokens."""
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Say hello."}])
    prompts = {
        "short": tokenizer.encode("The capital of France is"),
        "blocks": tokenizer.encode(LONG_TEXT)[:47],
        "chat": tokenizer.encode(chat, add_special_tokens=False),
        "long": tokenizer.encode(LONG_TEXT),
    }
    assert len(prompts["short"]) < BLOCK_SIZE and len(prompts["long"]) > 300
    return prompts


def assert_same(got: dict[str, Generated], cold: dict[str, Generated], what: str) -> None:
    for rid, ref in cold.items():
        g = got[rid]
        assert g.token_ids == ref.token_ids, f"{what}: {rid} generated other tokens"
        # Exact: logprobs bit for bit, not within a tolerance.
        assert g.logprobs == ref.logprobs, f"{what}: {rid} logprobs {g.logprobs} != cold {ref.logprobs}"
        assert g.text == ref.text
        assert len(g.logprobs) == MAX_TOKENS


@pytest.fixture
def amx(request):
    """AMX on for the modes that name it, off otherwise. On a CPU without AMX the
    AMX kernel runs on software tiles (``ops.set_amx_emulated``)."""
    wanted = "amx" in request.node.callspec.params["mode"]
    emulated = wanted and not ops.amx_usable() and ops.set_amx_emulated(True)
    try:
        if wanted and not ops.amx_usable() and not emulated:
            pytest.skip("this CPU has neither AMX-INT8 nor AVX512-VNNI to emulate it on")
        assert ops.amx_usable() or not wanted, "the AMX kernel differs from VNNI on the start-up self-check"
        yield wanted
    finally:
        if emulated:
            ops.set_amx_emulated(False)
        ops.set_amx_enabled(False)


# The default model (30 layers, its real vocabulary: 5-7x the small one's time a mode) on the
# paths the path choice picks on a CPU (w4a8; amx-bf16 and w4a16 where it has AMX-BF16) and
# bfloat16 activations; the small Qwen2-shaped model (its tensors of many GGUF types) on every
# mode, the exact float path, int4 and every KV cache dtype among them.
DEFAULT_MODEL_MODES = [("float32", "w4a8", "float16"), ("float32", "w4a8", "float16", "amx"),
                       ("float32", "amx-bf16", "float16"), ("float32", "w4a16", "float16"),
                       ("bfloat16", "w4a8", "bfloat16")]
GRID = [(model, mode) for model in MODELS for mode in MODES if model != "smollm2" or mode in DEFAULT_MODEL_MODES]


@pytest.mark.parametrize(("model_name", "mode"), GRID, ids=[f"{'-'.join(mode)}-{model}" for model, mode in GRID])
def test_logprobs_do_not_depend_on_how_a_request_was_computed(mode, amx, model_name, model_files):
    if mode[1] in ("amx-bf16", "w4a16") and not ops.amx_bf16_usable():
        pytest.skip(f"{mode[1]} runs where the CPU has AMX-BF16 (tdpbf16ps has no exact software twin)")
    check_invariance(model_files[model_name], mode, amx)


# A windowed layer beside a full one: the fused layer kernel (w4a8, int4) for the full
# layer and the op-by-op one for the windowed layer, float and bfloat16 activations.
WINDOWED_MODES = [("float32", "none", "float32"), ("float32", "w4a8", "float16"), ("bfloat16", "int4", "bfloat16")]


@pytest.mark.parametrize("mode", WINDOWED_MODES, ids=["-".join(m) for m in WINDOWED_MODES])
def test_a_windowed_layer_keeps_the_guarantee(mode, amx, model_files):
    model = model_files[WINDOWED]
    cold = check_invariance(model, mode, amx)
    assert max(len(ids) for ids in table(loaded_model(model, *mode[:2]).tokenizer).values()) > 10 * WINDOW
    # Every block kept for every layer: the same answers as the windowed group giving its blocks back.
    flat = make_engine(model, mode, enable_prefix_caching=False, hybrid_kv_cache=False)
    assert not flat.kv_layout.hybrid
    got = {}
    for rid, ids in table(flat.tokenizer).items():
        got.update(run(flat, {rid: ids}))
    assert_same(got, cold, "with every block kept")


def check_invariance(model: str, mode, amx: bool) -> dict[str, Generated]:
    """Run the table cold, then in every other way; each must equal the cold run. Returns it."""
    loaded = loaded_model(model, *mode[:2])
    tokenizer = loaded.tokenizer
    # (the AMX kernel's projections: grouped int8 ones; w4a8 on a GGUF keeps each type's own
    # format instead, VNNI's dots at every size, unless a type has none)
    grouped = any(isinstance(m, QuantizedLinear) and m.int8_activations for m in loaded.model.modules())
    ops.set_amx_enabled(amx)  # after the load, which sets it to the path's own choice
    assert ops.amx_enabled() == amx
    emulated_products = ops.amx_emulated_products()
    prompts = table(tokenizer)
    # (a) cold: each prompt alone, in one prefill, nothing cached.
    alone = make_engine(model, mode, enable_prefix_caching=False)
    cold = {}
    for rid, ids in prompts.items():
        cold.update(run(alone, {rid: ids}))

    # (b) a prefix cache hit: each prompt again after itself (all its full blocks
    # cached), and the long one after a one-block prefix of it.
    cached = make_engine(model, mode)
    run(cached, {"warm": prompts["long"][:BLOCK_SIZE + 3]})
    again = run(cached, {"long": prompts["long"]})
    assert again["long"].num_cached_tokens == BLOCK_SIZE
    assert_same(again, {"long": cold["long"]}, "after a one-block prefix")
    for rid, ids in prompts.items():
        run(cached, {f"first-{rid}": ids})
        again = run(cached, {rid: ids})
        assert again[rid].num_cached_tokens >= (len(ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
        assert_same(again, {rid: cold[rid]}, "prefix cache hit")

    # (c) chunked prefill, 16 and 48 tokens a step (each prompt alone).
    for budget in (16, 48):
        chunked = make_engine(model, mode, enable_prefix_caching=False, max_num_batched_tokens=budget)
        got = {}
        for rid, ids in prompts.items():
            got.update(run(chunked, {rid: ids}))
        assert_same(got, cold, f"chunks of {budget}")

    # (d) in a batch of 16: fillers first, the table's prompts arriving while
    # they decode, so prompts run beside decodes and beside each other.
    batch = {f"filler-{i}": tokenizer.encode(t) for i, t in enumerate(FILLERS)} | prompts
    arrivals = {rid: 2 + i for i, rid in enumerate(prompts)}
    got = run(make_engine(model, mode, enable_prefix_caching=False), batch, arrivals)
    assert_same(got, cold, "in a batch of 16")

    # (e) a KV cache one block short of the whole batch: requests are preempted and recomputed.
    need = sum(-(-(len(ids) + MAX_TOKENS) // BLOCK_SIZE) for ids in prompts.values())
    if not alone.kv_layout.hybrid:
        small = make_engine(model, mode, num_blocks=need - 1, enable_prefix_caching=False)
    else:
        # A windowed group gives its blocks back as a request goes: the least room that holds
        # one sequence of steps of 64 tokens (31 blocks here) is what makes them take turns.
        least = alone.kv_layout.blocks_for(MAX_MODEL_LEN, BLOCK_SIZE, 64)
        small = make_engine(model, mode, num_blocks=least, enable_prefix_caching=False, max_num_batched_tokens=64)
    got = run(small, prompts)
    assert small.scheduler.num_preemptions_total > 0
    assert_same(got, cold, "after preemption")
    if amx and not ops.amx_hardware():  # the emulated AMX kernel ran where the model has its projections
        assert (ops.amx_emulated_products() > emulated_products) == grouped
    return cold

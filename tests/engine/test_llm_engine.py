"""LLMEngine on the real default model: batching invariance, sampling, stops, streaming, stats, validation.

Expected outputs are never hard-coded: each behaviour is checked by comparing
runs of the same engine code against each other (in a batch vs alone, with vs
without a stop string, ...). Greedy runs use float32, where a request's tokens
must not depend on what else shares its batch.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from engine import llm_engine as llm_engine_module
from engine.config import (CPU_BUDGET, CUDA_KV_CACHE_FRACTION, CUDA_MAX_NUM_BATCHED_TOKENS, CUDA_MAX_NUM_SEQS, MiB,
                           EngineConfig, StepBudget, cpu_kv_budget, step_budget)
from engine.input_processor import default_max_tokens, sampling_defaults, sampling_overrides
from engine.llm_engine import LLMEngine
from engine.model_runner import kv_bytes_per_block
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.stats import StepStats
from engine.validation import InvalidRequestError

pytestmark = pytest.mark.slow


BLOCK_SIZE = 16
MAX_MODEL_LEN = 256
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)

LONG_PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
    "metal type, oil-based ink and a wooden screw press adapted from wine making. Before his workshop in Mainz, books "
    "were copied by hand in monasteries, which made them rare and expensive. Within fifty years presses had spread to "
    "more than two hundred cities across Europe, and millions of books were printed. Historians often say that this "
    "change helped the Reformation, the scientific revolution and the growth of literacy. In one sentence, the main "
    "effect of the press was",
    "A recipe for a simple tomato soup: heat two spoons of olive oil in a large pot, add one chopped onion and two "
    "cloves of garlic, and cook them slowly until they are soft and golden. Add a kilo of ripe tomatoes cut into "
    "pieces, a pinch of salt, a little sugar and half a litre of vegetable stock. Let everything simmer for twenty "
    "minutes, then blend until smooth and season with black pepper and fresh basil. Serve it hot with bread. The most "
    "important step in this recipe is",
    "def merge_sorted(a, b):\n    result = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            result.append(a[i])\n            i += 1\n        else:\n"
    "            result.append(b[j])\n            j += 1\n    result.extend(a[i:])\n    result.extend(b[j:])\n"
    "    return result\n\n\ndef test_merge_sorted():\n    assert merge_sorted([1, 4, 9], [2, 3, 10]) ==",
    "Dear hiring committee, I am writing to apply for the position of junior data analyst that was advertised on "
    "your website last week. I recently graduated with a degree in statistics, and during my studies I worked on "
    "projects about weather forecasting, public transport delays and hospital waiting times. I enjoy cleaning messy "
    "data, building clear charts and explaining results to people who are not experts. I am confident that my "
    "skills would help your team, and",
]
SHORT_PROMPTS = [
    "Hello", "The capital of France is", "1, 2, 3, 4,", "Once upon a time", "Water boils at",
    "The opposite of hot is", "My favourite colour is", "def add(a, b):", "Translate to French: cat",
    "The sun rises in the", "Q: What is 7 times 8?\nA:", "Roses are red,",
]
# Each wave of 8 (see run_staggered) mixes long and short prompts.
PROMPTS = (SHORT_PROMPTS[:2] + LONG_PROMPTS[:2] + SHORT_PROMPTS[2:6]
           + LONG_PROMPTS[2:3] + SHORT_PROMPTS[6:9] + LONG_PROMPTS[3:] + SHORT_PROMPTS[9:])


# -- builders ---------------------------------------------------------------


def make_engine(loaded, num_blocks: int = 64, **overrides) -> LLMEngine:
    """An engine on the shared weights with a KV cache of exactly ``num_blocks`` blocks."""
    budget = num_blocks * kv_bytes_per_block(loaded.config, loaded.dtype, BLOCK_SIZE)
    # float32 cache: the budget above counts float32 blocks.
    settings = dict(dtype="float32", device="cpu", kv_cache_memory=budget, block_size=BLOCK_SIZE,
                    max_model_len=MAX_MODEL_LEN, kv_cache_dtype="float32")
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings), loaded=loaded)


@dataclass
class Sample:
    """One sample of one request, assembled from its deltas."""

    token_ids: list[int] = field(default_factory=list)
    deltas: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0

    @property
    def text(self) -> str:
        return "".join(self.deltas)


class Collector:
    """Assembles deltas into samples, checking the delta protocol on the way."""

    def __init__(self) -> None:
        self.samples: dict[tuple[str, int], Sample] = {}
        self.finished: set[str] = set()

    def add(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            assert out.error is None
            assert out.request_id not in self.finished, "a delta after the request's last one"
            for o in out.outputs:
                sample = self.samples.setdefault((out.request_id, o.index), Sample())
                assert sample.finish_reason is None, "a delta after the sample finished"
                sample.token_ids.extend(o.token_ids)
                sample.deltas.append(o.text)
                sample.finish_reason = o.finish_reason
                sample.stop_reason = o.stop_reason
                sample.num_cached_tokens = out.num_cached_tokens
            if out.finished:
                self.finished.add(out.request_id)

    def __getitem__(self, request_id: str) -> Sample:
        return self.samples[(request_id, 0)]


def run_until_done(engine: LLMEngine, collector: Collector | None = None, max_steps: int = 2000) -> Collector:
    """Step until every request has finished."""
    collector = collector or Collector()
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return collector
        collector.add(engine.step())
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def run_alone(engine: LLMEngine, prompt_ids: list[int], params: SamplingParams, request_id: str = "alone") -> Sample:
    """Run one request on an otherwise idle engine."""
    assert not engine.has_unfinished_requests()
    engine.add_request(request_id, prompt_ids, params)
    return run_until_done(engine)[request_id]


def run_staggered(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> Collector:
    """Add the first half, step a few times, add the second half while the first is mid-flight."""
    half = len(prompts) // 2
    collector = Collector()
    for i, ids in enumerate(prompts[:half]):
        engine.add_request(f"r{i}", ids, params)
    for _ in range(3):
        collector.add(engine.step())
    assert engine.num_unfinished_requests == half, "the second wave must join while the first is in flight"
    for i, ids in enumerate(prompts[half:], half):
        engine.add_request(f"r{i}", ids, params)
    return run_until_done(engine, collector)


class StatsRecorder:
    """A stat logger that keeps every step's stats."""

    def __init__(self) -> None:
        self.steps: list[StepStats] = []

    def record(self, stats: StepStats) -> None:
        self.steps.append(stats)


def assert_engine_idle(engine: LLMEngine) -> None:
    assert not engine.has_unfinished_requests()
    assert engine.num_unfinished_requests == 0
    assert engine.kv_cache.stats.num_blocks_used == 0
    assert engine.kv_cache.num_requests == 0
    assert engine.scheduler.num_running == 0 and engine.scheduler.num_waiting == 0


# -- fixtures ---------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(smollm2_loaded):
    return smollm2_loaded.tokenizer


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def alone_outputs(smollm2_loaded, prompt_ids) -> list[Sample]:
    """Each prompt's greedy output when it runs by itself."""
    engine = make_engine(smollm2_loaded)
    return [run_alone(engine, ids, GREEDY, request_id=f"alone{i}") for i, ids in enumerate(prompt_ids)]


# -- batching invariance ----------------------------------------------------


def test_prompts_cover_long_and_short(prompt_ids):
    lengths = sorted(len(ids) for ids in prompt_ids)
    assert len(prompt_ids) == 16
    assert lengths[0] <= 3 and lengths[-4] >= 80
    assert max(lengths) + MAX_TOKENS <= MAX_MODEL_LEN


@pytest.mark.parametrize("setting", ["plain", "preemption", "chunked_prefill"])
def test_greedy_batch_matches_each_request_alone(smollm2_loaded, prompt_ids, alone_outputs, setting):
    if setting == "plain":
        engine = make_engine(smollm2_loaded)
    elif setting == "preemption":
        # One block more than a single max_model_len sequence needs: the batch cannot fit at once.
        engine = make_engine(smollm2_loaded, num_blocks=MAX_MODEL_LEN // BLOCK_SIZE + 1)
    else:
        engine = make_engine(smollm2_loaded, max_num_batched_tokens=8)
    recorder = StatsRecorder()
    engine.stat_loggers.append(recorder)

    batch = run_staggered(engine, prompt_ids, GREEDY)

    for i, alone in enumerate(alone_outputs):
        got = batch[f"r{i}"]
        assert got.token_ids == alone.token_ids, f"prompt {i} ({PROMPTS[i][:30]!r}) diverged in the batch"
        assert got.text == alone.text
        assert got.finish_reason == alone.finish_reason
    if setting == "preemption":
        assert engine.scheduler.num_preemptions_total > 0
        assert sum(s.num_preemptions for s in recorder.steps) == engine.scheduler.num_preemptions_total
    if setting == "chunked_prefill":
        assert max(s.num_batched_tokens for s in recorder.steps) <= 8
    assert_engine_idle(engine)


def test_priorities_change_the_order_not_the_answers(smollm2_loaded, prompt_ids, alone_outputs):
    # --scheduling-policy priority, a cache too small for the batch: the first wave (priority 2)
    # runs when a second (priorities 0 and 1) arrives. Preemptions take the least urgent,
    # admissions follow the priorities, and every answer is still the one it gets alone.
    engine = make_engine(smollm2_loaded, num_blocks=MAX_MODEL_LEN // BLOCK_SIZE + 1, scheduling_policy="priority")
    half = len(prompt_ids) // 2
    priority = {f"r{i}": 2 if i < half else i % 2 for i in range(len(prompt_ids))}
    victims: list[int] = []
    preempt = engine.scheduler._preempt

    def recording(request):
        victims.append(request.priority)
        preempt(request)

    engine.scheduler._preempt = recording
    collector, first_token_step = Collector(), {}
    for step in range(2000):
        if step in (0, 3):
            for i in range(0, half) if step == 0 else range(half, len(prompt_ids)):
                engine.add_request(f"r{i}", prompt_ids[i], dataclasses.replace(GREEDY, priority=priority[f"r{i}"]))
        if step > 3 and not engine.has_unfinished_requests():
            break
        outputs = engine.step()
        collector.add(outputs)
        for out in outputs:
            if any(o.token_ids for o in out.outputs):
                first_token_step.setdefault(out.request_id, step)
    for i, alone in enumerate(alone_outputs):
        got = collector[f"r{i}"]
        assert (got.token_ids, got.text, got.finish_reason) == (alone.token_ids, alone.text, alone.finish_reason), i
    assert victims and victims[0] == 2, victims
    second = {p: [first_token_step[r] for r in first_token_step if int(r[1:]) >= half
                  and priority[r] == p] for p in (0, 1)}
    # No request of the second wave starts answering before every more urgent one has.
    assert max(second[0]) <= min(second[1]), second
    assert_engine_idle(engine)


def test_a_priority_is_refused_without_the_priority_policy(small_engine, tokenizer):
    with pytest.raises(InvalidRequestError, match="--scheduling-policy priority") as excinfo:
        small_engine.add_request("p", tokenizer.encode("Hi"), dataclasses.replace(GREEDY, priority=1))
    assert excinfo.value.param == "priority"
    assert not small_engine.has_unfinished_requests()


def test_finished_request_frees_its_blocks_while_others_run(smollm2_loaded, tokenizer):
    engine = make_engine(smollm2_loaded)
    engine.add_request("short", tokenizer.encode(SHORT_PROMPTS[1]), SamplingParams(temperature=0, max_tokens=2))
    engine.add_request("long", tokenizer.encode(LONG_PROMPTS[0]), SamplingParams(temperature=0, max_tokens=6))
    collector = Collector()
    while "short" not in collector.finished:
        collector.add(engine.step())
    long_blocks = len(engine.kv_cache.get_block_ids("long"))
    assert engine.kv_cache.get_block_ids("short") == []
    assert engine.kv_cache.stats.num_blocks_used == long_blocks
    run_until_done(engine, collector)
    assert_engine_idle(engine)


# -- sampling ---------------------------------------------------------------


def test_n2_seeded_gives_two_reproducible_samples(smollm2_loaded, tokenizer):
    engine = make_engine(smollm2_loaded)
    params = SamplingParams(n=2, temperature=1.0, seed=1234, max_tokens=8, ignore_eos=True)

    runs = []
    for attempt in range(2):
        engine.add_request(f"n2-{attempt}", tokenizer.encode(SHORT_PROMPTS[3]), params)
        collector = run_until_done(engine)
        runs.append([collector.samples[(f"n2-{attempt}", i)] for i in range(2)])

    first, second = runs
    assert [s.token_ids for s in first] == [s.token_ids for s in second]
    assert [s.text for s in first] == [s.text for s in second]
    assert all(len(s.token_ids) == 8 and s.finish_reason == "length" for s in first)
    assert first[0].token_ids != first[1].token_ids, "the n samples must be independent draws"
    assert_engine_idle(engine)


def test_seeded_sample_is_the_same_alone_and_in_a_batch(smollm2_loaded, tokenizer):
    engine = make_engine(smollm2_loaded)
    prompt = tokenizer.encode(SHORT_PROMPTS[3])
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=8, ignore_eos=True)
    alone = run_alone(engine, prompt, seeded)

    engine.add_request("greedy", tokenizer.encode(SHORT_PROMPTS[1]), GREEDY)
    engine.add_request("unseeded", tokenizer.encode(LONG_PROMPTS[0]), SamplingParams(temperature=1.0, max_tokens=8))
    collector = Collector()
    collector.add(engine.step())
    engine.add_request("seeded", prompt, seeded)
    engine.add_request("other-seed", prompt, SamplingParams(temperature=0.9, top_p=0.95, seed=8,
                                                                   max_tokens=8, ignore_eos=True))
    run_until_done(engine, collector)

    assert collector["seeded"].token_ids == alone.token_ids
    assert collector["seeded"].text == alone.text
    assert_engine_idle(engine)


# -- stop strings and streaming ---------------------------------------------


def test_stop_string_cuts_the_text_and_never_streams(smollm2_loaded, tokenizer):
    engine = make_engine(smollm2_loaded)
    prompt = tokenizer.encode("Write a short story about a fox and a crow.\n\nOnce upon a time")
    free = run_alone(engine, prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    words = re.findall(r"[A-Za-z]{3,}", free.text)
    assert len(words) >= 3, f"need a few words to pick from, got {free.text!r}"
    stop = words[len(words) // 2]
    cut = free.text.index(stop)
    assert cut > 0

    stopped = run_alone(engine, prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]))

    assert stopped.finish_reason == "stop"
    assert stopped.stop_reason == stop
    assert all(stop not in delta for delta in stopped.deltas)
    assert stopped.text == free.text[:cut]
    assert stopped.token_ids == free.token_ids[:len(stopped.token_ids)]
    assert len(stopped.token_ids) < len(free.token_ids)
    assert_engine_idle(engine)


def test_chinese_output_streams_whole_characters(smollm2_loaded, tokenizer):
    engine = make_engine(smollm2_loaded)
    prompt = tokenizer.encode("北京是中国的首都。上海是")
    out = run_alone(engine, prompt, SamplingParams(temperature=0, max_tokens=12))

    # The premise: some tokens are only part of a character on their own.
    assert any("\ufffd" in tokenizer.decode([t]) for t in out.token_ids)
    assert any(ord(c) > 0x7F for c in out.text)
    assert all("\ufffd" not in delta for delta in out.deltas)
    assert out.text == tokenizer.decode(out.token_ids)
    assert_engine_idle(engine)


# -- stats ------------------------------------------------------------------


def test_step_stats_sum_to_the_tokens_of_the_responses(smollm2_loaded, tokenizer):
    engine = make_engine(smollm2_loaded)
    recorder = StatsRecorder()
    engine.stat_loggers.append(recorder)
    requests = {
        "a": (tokenizer.encode(SHORT_PROMPTS[1]), SamplingParams(temperature=0, max_tokens=5)),
        "b": (tokenizer.encode(SHORT_PROMPTS[3]), SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=4)),
        "c": (tokenizer.encode(LONG_PROMPTS[1]), SamplingParams(temperature=0, max_tokens=6)),
    }
    collector = Collector()
    for rid in ("a", "b"):
        engine.add_request(rid, *requests[rid])
    collector.add(engine.step())
    engine.add_request("c", *requests["c"])
    run_until_done(engine, collector)

    generated = sum(len(s.token_ids) for s in collector.samples.values())
    assert sum(s.num_generation_tokens for s in recorder.steps) == generated
    assert sum(s.num_prompt_tokens for s in recorder.steps) == sum(len(ids) for ids, _ in requests.values())
    finished = [f for s in recorder.steps for f in s.finished]  # one record per sample
    assert sorted(f.num_generation_tokens for f in finished) == sorted(
        len(s.token_ids) for s in collector.samples.values())
    assert recorder.steps[-1].kv_blocks_used == 0
    assert recorder.steps[-1].num_running == recorder.steps[-1].num_waiting == 0


# -- validation -------------------------------------------------------------


@pytest.fixture(scope="module")
def small_engine(smollm2_loaded) -> LLMEngine:
    return make_engine(smollm2_loaded, num_blocks=MAX_MODEL_LEN // BLOCK_SIZE)


def test_empty_prompt_is_rejected(small_engine):
    with pytest.raises(ValueError, match="empty"):
        small_engine.add_request("empty", [], GREEDY)
    assert_engine_idle(small_engine)


@pytest.mark.parametrize("bad_id", [-1, "vocab_size"])
def test_out_of_vocabulary_token_is_rejected(small_engine, bad_id):
    vocab = small_engine.model_config.vocab_size
    bad = vocab if bad_id == "vocab_size" else bad_id
    with pytest.raises(ValueError, match=rf"{bad}\b"):
        small_engine.add_request("oov", [1, 2, bad], GREEDY)
    assert_engine_idle(small_engine)


def test_prompt_plus_max_tokens_over_the_context_names_both(small_engine):
    prompt = [42] * 250
    with pytest.raises(ValueError) as excinfo:
        small_engine.add_request("too-long", prompt, SamplingParams(temperature=0, max_tokens=17))
    message = str(excinfo.value)
    assert re.search(r"\b250\b", message) and re.search(r"\b17\b", message), message
    assert str(MAX_MODEL_LEN) in message
    assert_engine_idle(small_engine)


def test_kv_budget_too_small_for_max_model_len_fails_at_construction(smollm2_loaded):
    with pytest.raises(ValueError, match=r"kv[-_]cache[-_]memory"):
        make_engine(smollm2_loaded, num_blocks=MAX_MODEL_LEN // BLOCK_SIZE - 1)


def test_duplicate_request_id_is_rejected(small_engine, tokenizer):
    prompt = tokenizer.encode(SHORT_PROMPTS[1])
    small_engine.add_request("dup", prompt, GREEDY)
    with pytest.raises(ValueError, match="dup"):
        small_engine.add_request("dup", prompt, GREEDY)
    assert small_engine.abort_request("dup").outputs[0].finish_reason == "abort"
    assert_engine_idle(small_engine)


def test_the_path_choice_times_a_prompt_chunk_of_the_default_step_budget():
    # models/ cannot import engine/, so models.autotune keeps its own copy of the
    # default budget: a prompt chunk the engine never runs would time the wrong step.
    from models import autotune

    assert autotune.PROMPT_TOKENS == CPU_BUDGET.max_num_batched_tokens


GiB = 2**30


def test_step_budget_takes_each_unset_size_from_the_device():
    cpu = step_budget(EngineConfig(), "cpu", max_model_len=8192, kv_bytes_per_token=23040, free_memory=20 * GiB)
    assert (cpu.max_num_seqs, cpu.max_num_batched_tokens) == (CPU_BUDGET.max_num_seqs,
                                                              CPU_BUDGET.max_num_batched_tokens)
    assert cpu.kv_cache_memory == cpu_kv_budget(CPU_BUDGET.max_num_seqs, 23040, 20 * GiB)
    cuda = step_budget(EngineConfig(), "cuda", max_model_len=8192, kv_bytes_per_token=23040, free_memory=10 * GiB)
    assert (cuda.max_num_seqs, cuda.max_num_batched_tokens) == (CUDA_MAX_NUM_SEQS, CUDA_MAX_NUM_BATCHED_TOKENS)
    assert cuda.kv_cache_memory == int(CUDA_KV_CACHE_FRACTION * 10 * GiB)
    # A large GPU: no more than max_num_seqs sequences of max_model_len need.
    big = step_budget(EngineConfig(max_num_seqs=8), "cuda", max_model_len=1000, kv_bytes_per_token=100,
                      free_memory=100 * GiB)
    assert big.kv_cache_memory == 8 * 1000 * 100 and big.max_num_seqs == 8
    # What the configuration sets wins on either device.
    mine = EngineConfig(max_num_seqs=3, max_num_batched_tokens=77, kv_cache_memory=12345)
    for device in ("cpu", "cuda"):
        assert step_budget(mine, device, 8192, 23040, free_memory=GiB) == StepBudget(3, 77, 12345)
    with pytest.raises(ValueError, match="free memory"):
        step_budget(EngineConfig(), "cuda", 8192, 23040)


def test_the_cpus_kv_budget_follows_the_model_and_the_memory():
    # 64 sequences of 1024 tokens...
    assert cpu_kv_budget(64, 28672, 20 * GiB) == 64 * 1024 * 28672
    # ...within a quarter of the memory available...
    assert cpu_kv_budget(64, 28672, 4 * GiB) == GiB
    # ...and never under 512 MiB where that quarter allows it.
    assert cpu_kv_budget(64, 1000, 20 * GiB) == 512 * MiB
    assert cpu_kv_budget(64, 1000, GiB) == GiB // 4
    assert cpu_kv_budget(8, 28672, None) == 512 * MiB


def test_the_engine_sizes_its_kv_cache_and_steps_by_the_budget(smollm2_loaded, monkeypatch):
    monkeypatch.setattr(llm_engine_module, "available_memory", lambda: 20 * GiB)
    engine = LLMEngine(EngineConfig(dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN),
                       loaded=smollm2_loaded)
    block = kv_bytes_per_block(smollm2_loaded.config, torch.float16, engine.block_size)
    assert engine.budget == StepBudget(CPU_BUDGET.max_num_seqs, CPU_BUDGET.max_num_batched_tokens,
                                       cpu_kv_budget(CPU_BUDGET.max_num_seqs, block // engine.block_size, 20 * GiB))
    assert engine.num_blocks == engine.budget.kv_cache_memory // block
    assert engine.scheduler.config.max_num_seqs == CPU_BUDGET.max_num_seqs
    assert engine.scheduler.config.max_num_batched_tokens == CPU_BUDGET.max_num_batched_tokens


def test_a_context_that_does_not_fit_shrinks_unless_it_was_asked_for(smollm2_loaded, caplog):
    block = kv_bytes_per_block(smollm2_loaded.config, torch.float16, 16)
    # The model's own context (8192 tokens) in a cache of 100 blocks: serve 1600 tokens, say so.
    with caplog.at_level("WARNING"):
        engine = LLMEngine(EngineConfig(dtype="float32", device="cpu", kv_cache_memory=100 * block, block_size=16),
                           loaded=smollm2_loaded)
    assert smollm2_loaded.config.max_position_embeddings > 1600
    assert engine.max_model_len == 1600 and engine.scheduler.config.max_model_len == 1600
    assert "serving max_model_len=1600" in caplog.text and "--kv-cache-memory" in caplog.text
    # A length the user asked for stays an error.
    with pytest.raises(ValueError, match="cannot hold one sequence of max_model_len=4096"):
        LLMEngine(EngineConfig(dtype="float32", device="cpu", kv_cache_memory=100 * block, block_size=16,
                               max_model_len=4096), loaded=smollm2_loaded)


@pytest.mark.parametrize("setting", [{"kv_cache_memory": 0}, {"max_num_seqs": 0}, {"max_num_batched_tokens": -1}])
def test_a_size_below_one_is_refused(setting):
    with pytest.raises(ValueError, match=next(iter(setting))):
        EngineConfig(**setting)


def test_default_kv_cache_is_float16_and_holds_twice_the_blocks(smollm2_loaded, tokenizer):
    budget = 64 * kv_bytes_per_block(smollm2_loaded.config, torch.float32, BLOCK_SIZE)
    engine = LLMEngine(EngineConfig(dtype="float32", device="cpu", kv_cache_memory=budget, block_size=BLOCK_SIZE,
                                    max_model_len=MAX_MODEL_LEN), loaded=smollm2_loaded)
    assert engine.num_blocks == 128
    assert all(k.dtype == v.dtype == torch.float16 for k, v in engine.runner.kv_caches)

    [[fp16]] = engine.generate(["The capital of France is"], SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)
    [[fp32]] = make_engine(smollm2_loaded).generate(["The capital of France is"], SamplingParams(max_tokens=12, temperature=0.0),
                                                    use_tqdm=False)

    assert fp16.text == fp32.text


def test_int8_kv_cache_holds_about_twice_the_tokens_of_float16_and_generates(smollm2_loaded):
    budget = 64 * kv_bytes_per_block(smollm2_loaded.config, torch.float16, BLOCK_SIZE)
    engine = LLMEngine(EngineConfig(dtype="float32", device="cpu", kv_cache_memory=budget, block_size=BLOCK_SIZE,
                                    max_model_len=MAX_MODEL_LEN, kv_cache_dtype="int8"), loaded=smollm2_loaded)
    # A row of 64 int8 codes and a float32 scale against 64 float16 values: 128 / 68 bytes.
    assert engine.num_blocks == 64 * 128 // 68
    assert all(k.dtype == v.dtype == torch.int8 and k.shape[-1] == 68 for k, v in engine.runner.kv_caches)

    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    [[int8]] = engine.generate(["The capital of France is"], greedy, use_tqdm=False)
    [[fp32]] = make_engine(smollm2_loaded).generate(["The capital of France is"], greedy, use_tqdm=False)

    # Logits move by up to about 1 (test_ops): the first tokens still agree.
    assert int8.token_ids[:4] == fp32.token_ids[:4]
    assert_engine_idle(engine)


def test_a_chat_template_file_replaces_the_models_own(smollm2_loaded):
    path = Path(__file__).parents[1] / "data" / "hermes_chat_template.jinja"
    engine = make_engine(smollm2_loaded, num_blocks=MAX_MODEL_LEN // BLOCK_SIZE, chat_template=str(path))
    assert engine.tokenizer.chat_template == path.read_text()
    assert engine.tokenizer.tool_call_syntax == "hermes"
    assert smollm2_loaded.tokenizer.tool_call_syntax is None  # the shared weights' tokenizer is untouched
    with pytest.raises(ValueError, match="cannot read the chat template"):
        make_engine(smollm2_loaded, chat_template=str(path) + ".missing")


def test_the_models_sampling_defaults_unless_generation_config_vllm(caplog):
    from models.config import ModelConfig

    model = ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                        max_position_embeddings=64, sampling_defaults={"temperature": 0.6, "top_k": 20})
    assert sampling_defaults(EngineConfig(), model) == {"temperature": 0.6, "top_k": 20}
    assert sampling_defaults(EngineConfig(generation_config="vllm"), model) == {}
    broken = dataclasses.replace(model, sampling_defaults={"top_p": 1.5})
    assert sampling_defaults(EngineConfig(), broken) == {}
    assert "ignoring the model's generation_config.json sampling" in caplog.text
    with pytest.raises(ValueError, match="generation_config must be auto or vllm"):
        EngineConfig(generation_config="hf")
    longest = dataclasses.replace(model, max_new_tokens=7)
    assert default_max_tokens(EngineConfig(), longest) == 7
    assert default_max_tokens(EngineConfig(generation_config="vllm"), longest) is None
    assert default_max_tokens(EngineConfig(), model) is None
    # vLLM's --override-generation-config: over the model's values; alone with "vllm".
    override = {"temperature": 0.9, "dry_multiplier": 0.8, "mirostat": 2, "samplers": ["top_k", "temperature"],
                "max_new_tokens": 3}
    assert sampling_defaults(EngineConfig(override_generation_config=override), model) == {
        "temperature": 0.9, "top_k": 20, "dry_multiplier": 0.8, "mirostat": 2, "samplers": ["top_k", "temperature"]}
    assert sampling_defaults(EngineConfig(generation_config="vllm", override_generation_config=override),
                                        model) == {"temperature": 0.9, "dry_multiplier": 0.8, "mirostat": 2,
                                                   "samplers": ["top_k", "temperature"]}
    # The operator's part alone (llama.cpp's /completion applies it, not the model's values).
    assert sampling_overrides(EngineConfig(override_generation_config=override)) == {
        "temperature": 0.9, "dry_multiplier": 0.8, "mirostat": 2, "samplers": ["top_k", "temperature"]}
    assert sampling_overrides(EngineConfig()) == {}
    assert default_max_tokens(EngineConfig(override_generation_config=override), longest) == 3
    assert default_max_tokens(EngineConfig(generation_config="vllm", override_generation_config=override),
                                         model) == 3
    for bad, match in [({"max_tokens": 5}, "cannot set max_tokens"), ({"top_p": 2}, "top_p must be in"),
                       ({"max_new_tokens": 0}, "max_new_tokens must be"), ({"dry_base": "x"}, "dry_base"),
                       ({"mirostat": 2.0}, "mirostat must be an integer"), ({"mirostat": 3}, "mirostat must be 0"),
                       ({"samplers": "kt"}, "samplers must be a list"), ({"samplers": ["top-k"]}, "samplers must list")]:
        with pytest.raises(ValueError, match=match):
            EngineConfig(override_generation_config=bad)


def test_the_models_max_new_tokens_bounds_a_request_that_sets_no_length(smollm2_loaded, tokenizer):
    engine = make_engine(smollm2_loaded)
    engine.inputs.limits = dataclasses.replace(engine.inputs.limits, default_max_tokens=5)  # as generation_config's
    prompt = tokenizer.encode("Once upon a time")
    rest = dataclasses.replace(GREEDY, max_tokens=None, ignore_eos=True)
    engine.add_request("default", prompt, rest)
    engine.add_request("own", prompt, dataclasses.replace(rest, max_tokens=9))
    done = run_until_done(engine)
    assert len(done["default"].token_ids) == 5 and done["default"].finish_reason == "length"
    assert len(done["own"].token_ids) == 9  # a request's own length wins
    with pytest.raises(InvalidRequestError, match="default answer length"):
        engine.add_request("min", prompt, dataclasses.replace(rest, min_tokens=6))


def test_bad_words_are_never_generated(smollm2_loaded):
    # vLLM's bad_words: each word's tokens (as it is and after a space) never complete it.
    engine = make_engine(smollm2_loaded)
    prompt = "The capital of France is"
    [[free]] = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert "Paris" in free.text
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, bad_words=["Paris", "France"])
    [[banned]] = engine.generate([prompt], params, use_tqdm=False)
    assert "Paris" not in banned.text and "France" not in banned.text, banned.text
    words = engine.inputs.bad_words_token_ids(["Paris"])
    assert len(words) == 2 and all(w for w in words)
    assert_engine_idle(engine)

"""Scheduler: token budget, chunked prefill, preemption, admission limits, aborts.

A fake model stands in for the runner. It writes each scheduled token into its
KV slot, then computes the next token from the context it reads back through
the block table, so a wrong block table, a bad prefix hit or a stale block
changes the output. The reference output is the same function applied to the
plain token list.
"""

from __future__ import annotations

import pytest

from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from engine_builders import make_request

VOCAB = 1000


def next_token(context: list[int]) -> int:
    """A deterministic 'model': depends on every token and its position."""
    acc = len(context)
    for i, tok in enumerate(context):
        acc = (acc * 31 + (i + 1) * (tok + 7)) % 1_000_003
    return acc % VOCAB


def reference_output(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


class FakeModel:
    """A KV 'cache' of token ids, indexed by slot like the real tensors."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.block_size = kv.block_size
        self.slots: list[int | None] = [None] * (kv.num_blocks * kv.block_size)

    def _slot(self, block_ids: list[int], pos: int) -> int:
        return block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def step(self, out: SchedulerOutput) -> dict[str, list[int]]:
        # Write the whole batch first, as each layer does, then read.
        for item in out.scheduled:
            for j, tok in enumerate(item.token_ids):
                self.slots[self._slot(item.block_tables[0], item.start_pos + j)] = tok
        sampled = {}
        for item in out.scheduled:
            if item.sample:
                end = item.start_pos + item.num_new_tokens
                context = [self.slots[self._slot(item.block_tables[0], p)] for p in range(end)]
                sampled[item.request.request_id] = [next_token(context)]
        return sampled


def make_scheduler(num_blocks: int = 256, block_size: int = 16, max_model_len: int = 1024,
                   max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                   enable_prefix_caching: bool = True, max_loras: int | None = None) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
    config = SchedulerConfig(max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens, max_loras=max_loras)
    return Scheduler(config, kv)


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % VOCAB for i in range(length)]


def run(scheduler: Scheduler, model: FakeModel | None = None,
        max_steps: int = 10_000) -> list[SchedulerOutput]:
    """Step until every request finished, checking the per-step limits.

    Pass the ``model`` used for earlier steps: it holds their K/V.
    """
    model = model or FakeModel(scheduler.kv_cache)
    config = scheduler.config
    outputs = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return outputs
        out = scheduler.schedule()
        num_new = [s.num_new_tokens for s in out.scheduled]
        assert out.num_batched_tokens == sum(num_new) <= config.max_num_batched_tokens
        assert all(n > 0 for n in num_new)
        assert len({s.request.request_id for s in out.scheduled}) == len(out.scheduled)
        assert scheduler.num_running <= config.max_num_seqs
        scheduler.update_from_output(out, model.step(out))
        outputs.append(out)
    raise AssertionError("requests did not finish")


def add_all(scheduler: Scheduler, specs: list[tuple[int, int]]) -> list[Request]:
    """Add requests r0, r1, ... from (prompt length, max_tokens) pairs."""
    requests = [make_request(f"r{i}", prompt(i, n), max_tokens=m) for i, (n, m) in enumerate(specs)]
    for r in requests:
        scheduler.add_request(r)
    return requests


MIXED = [(5, 20), (150, 8), (33, 40), (16, 1), (90, 25), (1, 30), (64, 12), (200, 5),
         (17, 17), (48, 33), (120, 10), (7, 50)]


def test_token_budget_holds_every_step_and_outputs_match_the_reference(assert_scheduler_empty):
    scheduler = make_scheduler(max_num_batched_tokens=64, max_num_seqs=8)
    requests = add_all(scheduler, MIXED)
    outputs = run(scheduler)
    assert max(o.num_batched_tokens for o in outputs) == 64
    for r, (n, m) in zip(requests, MIXED):
        assert r.output_token_ids == reference_output(r.prompt_token_ids, m)
        assert r.status is RequestStatus.FINISHED_LENGTH
        assert r.finished_time is not None and r.first_scheduled_time is not None
    assert_scheduler_empty(scheduler)


def test_long_prompt_is_chunked_while_decodes_get_a_token_every_step(assert_scheduler_empty):
    scheduler = make_scheduler(max_num_batched_tokens=32)
    r0, r1 = add_all(scheduler, [(5, 50), (5, 50)])
    model = FakeModel(scheduler.kv_cache)
    for _ in range(2):
        out = scheduler.schedule()
        scheduler.update_from_output(out, model.step(out))
    long = make_request("long", prompt(9, 100), max_tokens=5)
    scheduler.add_request(long)

    chunks = []
    while long.num_output_tokens == 0:
        out = scheduler.schedule()
        by_id = {s.request.request_id: s for s in out.scheduled}
        assert [(by_id[r].num_new_tokens, by_id[r].sample) for r in ("r0", "r1")] == [(1, True)] * 2
        s = by_id["long"]
        chunks.append((s.start_pos, s.num_new_tokens, s.sample))
        received = scheduler.update_from_output(out, model.step(out))
        assert (long in [r for r, _ in received]) == s.sample
    assert chunks == [(0, 30, False), (30, 30, False), (60, 30, False), (90, 10, True)]
    run(scheduler, model)
    assert long.output_token_ids == reference_output(long.prompt_token_ids, 5)
    assert r0.output_token_ids == reference_output(r0.prompt_token_ids, 50)
    assert_scheduler_empty(scheduler)


def test_siblings_admitted_in_one_step_share_full_prompt_blocks(assert_scheduler_empty):
    scheduler = make_scheduler()
    shared = prompt(3, 40)
    a, b = make_request("a", shared, 10), make_request("b", shared, 10)
    scheduler.add_request(a)
    scheduler.add_request(b)
    model = FakeModel(scheduler.kv_cache)
    out = scheduler.schedule()
    assert out.admitted == ["a", "b"]
    sa, sb = out.scheduled
    assert sa.block_tables[0] == [0, 1, 2]
    assert sb.block_tables[0] == [0, 1, 3]
    assert (sb.start_pos, sb.num_new_tokens) == (32, 8)
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 32)
    stats = scheduler.kv_cache.stats
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (80, 32)
    scheduler.update_from_output(out, model.step(out))
    run(scheduler, model)
    assert a.output_token_ids == b.output_token_ids == reference_output(shared, 10)
    assert_scheduler_empty(scheduler)


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_preemption_when_blocks_run_out_keeps_every_output(enable_prefix_caching,
                                                           assert_scheduler_empty):
    specs = [(20, 40), (25, 40), (30, 35), (18, 44), (40, 20), (10, 50)]
    big = make_scheduler(num_blocks=256, max_num_batched_tokens=48)
    big_requests = add_all(big, specs)
    run(big)
    assert big.num_preemptions_total == 0

    small = make_scheduler(num_blocks=8, max_num_batched_tokens=48,
                           enable_prefix_caching=enable_prefix_caching)
    small_requests = add_all(small, specs)
    outputs = run(small)
    assert small.num_preemptions_total > 0
    assert sum(len(o.preempted) for o in outputs) == small.num_preemptions_total
    for rb, rs in zip(big_requests, small_requests):
        assert rs.output_token_ids == rb.output_token_ids
        assert rs.output_token_ids == reference_output(rs.prompt_token_ids, rs.max_tokens)
    assert any(r.num_preemptions > 0 for r in small_requests)
    assert_scheduler_empty(small)


def test_the_newest_running_request_is_preempted_and_waits_at_the_front(assert_scheduler_empty):
    # 4 blocks of 4 tokens; each request grows to 12 tokens (3 blocks).
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_model_len=64)
    r0, r1 = add_all(scheduler, [(4, 8), (4, 8)])
    r2 = make_request("r2", prompt(7, 4), 8)
    model = FakeModel(scheduler.kv_cache)
    out = scheduler.schedule()
    scheduler.update_from_output(out, model.step(out))
    scheduler.add_request(r2)  # arrives once r0 and r1 run; waits for blocks
    while not out.preempted:
        out = scheduler.schedule()
        if not out.preempted:
            scheduler.update_from_output(out, model.step(out))
    assert out.preempted == ["r1"]
    assert [s.request.request_id for s in out.scheduled] == ["r0"]
    assert out.admitted == []  # no admissions in a step that preempted
    assert r1.status is RequestStatus.PREEMPTED
    assert (r1.num_computed_tokens, r1.num_preemptions) == (0, 1)
    assert scheduler.kv_cache.get_block_ids("r1") == []
    assert list(scheduler.waiting) == [r1, r2]
    scheduler.update_from_output(out, model.step(out))
    run(scheduler, model)
    for r in (r0, r1, r2):
        assert r.output_token_ids == reference_output(r.prompt_token_ids, 8)
    assert_scheduler_empty(scheduler)


def test_the_request_being_scheduled_preempts_itself_when_it_is_the_newest(assert_scheduler_empty):
    # 3 blocks of 4 tokens: after one step each request holds a full block.
    scheduler = make_scheduler(num_blocks=3, block_size=4, max_model_len=64)
    r0, r1 = add_all(scheduler, [(4, 4), (4, 8)])
    model = FakeModel(scheduler.kv_cache)
    out = scheduler.schedule()
    assert out.admitted == ["r0", "r1"]
    scheduler.update_from_output(out, model.step(out))

    out = scheduler.schedule()  # r0 takes the last free block; r1 finds none
    assert [s.request.request_id for s in out.scheduled] == ["r0"]
    assert out.preempted == ["r1"]
    assert (scheduler.num_running, scheduler.num_waiting) == (1, 1)
    scheduler.update_from_output(out, model.step(out))
    run(scheduler, model)
    assert r0.output_token_ids == reference_output(r0.prompt_token_ids, 4)
    assert r1.output_token_ids == reference_output(r1.prompt_token_ids, 8)
    assert_scheduler_empty(scheduler)


def test_requests_that_can_never_fit_are_internal_errors(assert_scheduler_empty):
    # engine.validation refuses them before they get here (tests/engine/test_validation.py).
    scheduler = make_scheduler(num_blocks=4, block_size=16, max_model_len=100)
    with pytest.raises(AssertionError):
        scheduler.add_request(make_request("too-long", prompt(0, 90), max_tokens=20))
    with pytest.raises(AssertionError):
        scheduler.add_request(make_request("too-big", prompt(0, 60), max_tokens=10))
    with pytest.raises(AssertionError, match="empty prompt"):
        scheduler.add_request(make_request("empty", [], max_tokens=10))
    assert_scheduler_empty(scheduler)
    scheduler.add_request(make_request("fits", prompt(0, 54), max_tokens=10))
    with pytest.raises(AssertionError, match="already in use"):
        scheduler.add_request(make_request("fits", prompt(0, 5), max_tokens=10))
    assert scheduler.num_waiting == 1


def test_max_num_seqs_is_honoured(assert_scheduler_empty):
    scheduler = make_scheduler(max_num_seqs=2)
    requests = add_all(scheduler, [(10, 5)] * 5)
    model = FakeModel(scheduler.kv_cache)
    out = scheduler.schedule()
    assert out.admitted == ["r0", "r1"]
    assert (scheduler.num_running, scheduler.num_waiting) == (2, 3)
    scheduler.update_from_output(out, model.step(out))
    outputs = run(scheduler, model)
    assert max(len(o.scheduled) for o in outputs) == 2
    assert all(r.num_output_tokens == 5 for r in requests)
    assert_scheduler_empty(scheduler)


@pytest.mark.parametrize("max_loras", [None, 2])
def test_max_loras_bounds_the_adapters_running_at_once(max_loras, assert_scheduler_empty):
    # Requests of adapters a, b, c and of the base model. With max_loras 2, c's requests
    # wait while a and b run, the ones behind them (the base model's, a's) go ahead, and
    # c's run once a has no request left running.
    scheduler = make_scheduler(max_loras=max_loras)
    specs = [("a", 5), ("b", 20), ("c", 3), (None, 3), ("a", 3), ("c", 3)]
    requests = []
    for i, (adapter, max_tokens) in enumerate(specs):
        request = make_request(f"r{i}", prompt(i, 10), max_tokens=max_tokens)
        request.adapter = adapter
        scheduler.add_request(request)
        requests.append(request)
    outputs = run(scheduler)
    if max_loras is None:
        assert outputs[0].admitted == [f"r{i}" for i in range(6)]
    else:
        assert outputs[0].admitted == ["r0", "r1", "r3", "r4"]
        running = [{s.request.adapter for s in out.scheduled} - {None} for out in outputs]
        assert max(len(adapters) for adapters in running) == 2
        c_admitted = next(i for i, out in enumerate(outputs) if "r2" in out.admitted)
        a_last = max(i for i, adapters in enumerate(running) if "a" in adapters)
        assert c_admitted == a_last + 1 and "r5" in outputs[c_admitted].admitted
    for request, (_, max_tokens) in zip(requests, specs):
        assert request.output_token_ids == reference_output(request.prompt_token_ids, max_tokens)
    assert_scheduler_empty(scheduler)


def test_max_loras_must_be_positive():
    with pytest.raises(ValueError, match="max_loras must be at least 1, got 0"):
        SchedulerConfig(max_model_len=64, max_loras=0)


def test_abort_of_waiting_and_running_requests(assert_scheduler_empty):
    scheduler = make_scheduler(max_num_seqs=1)
    r0, r1, r2 = add_all(scheduler, [(20, 10), (20, 10), (20, 10)])
    model = FakeModel(scheduler.kv_cache)
    out = scheduler.schedule()
    scheduler.update_from_output(out, model.step(out))
    assert scheduler.kv_cache.get_block_ids("r0") == [0, 1]

    assert scheduler.abort_request("r2") is r2
    assert scheduler.abort_request("r0") is r0
    for r in (r0, r2):
        assert r.status is RequestStatus.FINISHED_ABORTED
        assert r.status.finish_reason == "abort"
        assert r.finished_time is not None
    assert scheduler.kv_cache.get_block_ids("r0") == []
    assert scheduler.kv_cache.stats.num_blocks_used == 0
    assert (scheduler.num_running, scheduler.num_waiting) == (0, 1)
    assert scheduler.abort_request("r0") is None
    assert scheduler.abort_request("nope") is None

    run(scheduler, model)
    assert r1.output_token_ids == reference_output(r1.prompt_token_ids, 10)
    assert_scheduler_empty(scheduler)


def test_abort_of_a_request_preempted_to_the_waiting_queue(assert_scheduler_empty):
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_model_len=64)
    r0, r1 = add_all(scheduler, [(4, 8), (4, 8)])
    model = FakeModel(scheduler.kv_cache)
    while r1.status is not RequestStatus.PREEMPTED:
        out = scheduler.schedule()
        scheduler.update_from_output(out, model.step(out))
    assert scheduler.abort_request("r1") is r1
    run(scheduler, model)
    assert r0.output_token_ids == reference_output(r0.prompt_token_ids, 8)
    assert_scheduler_empty(scheduler)


def test_finish_from_outside_with_a_stop_string(assert_scheduler_empty):
    scheduler = make_scheduler()
    [r0] = add_all(scheduler, [(10, 20)])
    model = FakeModel(scheduler.kv_cache)
    for _ in range(3):
        out = scheduler.schedule()
        scheduler.update_from_output(out, model.step(out))
    assert scheduler.finish_request("r0", RequestStatus.FINISHED_STOPPED) is r0
    assert r0.status.finish_reason == "stop"
    assert r0.num_output_tokens == 3
    with pytest.raises(ValueError, match="finished status"):
        scheduler.finish_request("r0", RequestStatus.RUNNING)
    assert_scheduler_empty(scheduler)


def test_eos_token_stops_the_request(assert_scheduler_empty):
    scheduler = make_scheduler()
    p = prompt(5, 12)
    ref = reference_output(p, 20)
    eos = ref[4]
    r = make_request("r0", p, max_tokens=20, eos_token_ids=[eos])
    scheduler.add_request(r)
    run(scheduler)
    assert r.output_token_ids == ref[:ref.index(eos) + 1]
    assert r.status is RequestStatus.FINISHED_STOPPED
    assert_scheduler_empty(scheduler)


def test_request_finishes_at_max_model_len():
    scheduler = make_scheduler(max_model_len=24)
    r = make_request("r0", prompt(1, 20), max_tokens=4)
    scheduler.add_request(r)
    run(scheduler)
    assert r.num_tokens == 24
    assert r.status is RequestStatus.FINISHED_LENGTH


def test_without_chunked_prefill_the_budget_must_hold_a_whole_request(assert_scheduler_empty):
    with pytest.raises(ValueError, match="chunked prefill"):
        SchedulerConfig(max_model_len=4096, max_num_batched_tokens=2048,
                        enable_chunked_prefill=False)
    kv = KVCacheManager(num_blocks=64)
    config = SchedulerConfig(max_model_len=100, max_num_batched_tokens=100,
                             enable_chunked_prefill=False)
    scheduler = Scheduler(config, kv)
    add_all(scheduler, [(60, 5), (60, 5)])
    model = FakeModel(kv)
    out = scheduler.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("r0", 60)]
    scheduler.update_from_output(out, model.step(out))
    run(scheduler, model)
    assert_scheduler_empty(scheduler)


def test_proposals_run_as_extra_positions_and_rejected_slots_are_given_back():
    scheduler = make_scheduler(num_blocks=16, block_size=2, max_num_batched_tokens=6)
    model = FakeModel(scheduler.kv_cache)
    req = make_request("r", prompt(1, 5), max_tokens=20)
    scheduler.add_request(req)
    scheduler.update_from_output(out := scheduler.schedule(), model.step(out))  # the prompt: 3 blocks
    truth = reference_output(req.prompt_token_ids, 20)
    assert req.output_token_ids == truth[:1]
    # Two right guesses, then wrong ones; the budget (6) cuts the proposals to 5.
    req.spec_token_ids = truth[1:3] + [999, 998, 997, 996]
    out = scheduler.schedule()
    [item] = out.scheduled
    assert item.spec_token_ids == truth[1:3] + [999, 998, 997] and item.num_new_tokens == 6
    assert item.token_ids == truth[:3] + [999, 998, 997]
    assert len(item.block_tables[0]) == 6  # positions 5..10
    model.step(out)
    # The engine keeps the two confirmed proposals and the model's next token.
    scheduler.update_from_output(out, {"r": truth[1:4]})
    assert req.output_token_ids == truth[:4] and req.num_computed_tokens == 8
    assert len(scheduler.kv_cache.get_block_ids("r")) == 5  # 9 tokens: the sixth block went back
    assert scheduler.kv_cache.num_free_blocks == 11
    run(scheduler, model)
    assert req.output_token_ids == truth  # the confirmed proposals' K/V were right


def test_proposals_never_preempt_and_stay_out_of_admissions():
    scheduler = make_scheduler(num_blocks=3, block_size=4)
    req = make_request("r", prompt(2, 5), max_tokens=4)
    scheduler.add_request(req)
    model = FakeModel(scheduler.kv_cache)
    scheduler.update_from_output(out := scheduler.schedule(), model.step(out))
    other = make_request("o", prompt(3, 3), max_tokens=2)
    scheduler.add_request(other)
    scheduler.update_from_output(out := scheduler.schedule(), model.step(out))  # both hold blocks now
    req.spec_token_ids = [1, 2, 3, 4, 5, 6, 7, 8]  # would need blocks that are not free
    out = scheduler.schedule()
    assert all(not s.spec_token_ids for s in out.scheduled) and not out.preempted


def prioritised(request_id: str, tokens: list[int], max_tokens: int, priority: int) -> Request:
    return Request(request_id=request_id, prompt_token_ids=tokens, max_tokens=max_tokens,
                   sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0, priority=priority))


def test_priorities_order_admissions(assert_scheduler_empty):
    scheduler = make_scheduler(max_num_seqs=1)
    priorities = [2, 0, 1, 0, -1]
    requests = [prioritised(f"r{i}", prompt(i, 6), 3, p) for i, p in enumerate(priorities)]
    for r in requests:
        scheduler.add_request(r)
    outputs = run(scheduler)
    assert [rid for o in outputs for rid in o.admitted] == ["r4", "r1", "r3", "r2", "r0"]
    for r in requests:
        assert r.output_token_ids == reference_output(r.prompt_token_ids, 3)
    assert_scheduler_empty(scheduler)


def test_the_lowest_priority_running_request_is_preempted_not_the_newest(assert_scheduler_empty):
    # As test_the_newest_running_request_is_preempted_...: 4 blocks of 4 tokens, requests of
    # 12 tokens. r0 is older but less urgent, so it runs after r1 and is the one preempted.
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_model_len=64)
    r0, r1 = prioritised("r0", prompt(0, 4), 8, 1), prioritised("r1", prompt(1, 4), 8, 0)
    model = FakeModel(scheduler.kv_cache)
    for r in (r0, r1):  # r0 is admitted a step before r1
        scheduler.add_request(r)
        out = scheduler.schedule()
        assert out.admitted == [r.request_id]
        scheduler.update_from_output(out, model.step(out))
    assert scheduler.running == [r1, r0]
    r2 = prioritised("r2", prompt(7, 4), 8, 0)
    scheduler.add_request(r2)  # waits for blocks
    while not out.preempted:
        out = scheduler.schedule()
        if not out.preempted:
            scheduler.update_from_output(out, model.step(out))
    assert out.preempted == ["r0"]
    assert [s.request.request_id for s in out.scheduled] == ["r1"]
    # The new urgent request waits ahead of the preempted less urgent one.
    assert list(scheduler.waiting) == [r2, r0]
    scheduler.update_from_output(out, model.step(out))
    outputs = run(scheduler, model)
    admitted = [rid for o in outputs for rid in o.admitted]
    assert admitted[0] == "r2" and admitted[-1] == "r0" and admitted.count("r0") == 1
    for r in (r0, r1, r2):
        assert r.output_token_ids == reference_output(r.prompt_token_ids, 8)
    assert_scheduler_empty(scheduler)


def test_running_requests_are_ordered_by_priority_then_admission():
    scheduler = make_scheduler()
    for i, p in enumerate([3, 1, 3, 0, 1]):
        scheduler.add_request(prioritised(f"r{i}", prompt(i, 4), 4, p))
        scheduler.schedule()  # admitted one step at a time: running holds them in this order
    assert [r.request_id for r in scheduler.running] == ["r3", "r1", "r4", "r0", "r2"]


# -- a hybrid cache: a full-attention group and a windowed one ----------------------------

WINDOW = 24


def windowed_next_token(context: list[int]) -> int:
    """A 'model' with a full layer (every token) and a windowed one (the last WINDOW)."""
    return (next_token(context) + 7 * next_token(context[-WINDOW:])) % VOCAB


class HybridFakeModel(FakeModel):
    """Group 0 reads every position, group 1 only its window's: a block given back too
    early, or reused while a window still sees it, changes the output."""

    def step(self, out: SchedulerOutput) -> dict[str, list[int]]:
        for item in out.scheduled:
            for table in item.block_tables:
                for j, tok in enumerate(item.token_ids):
                    self.slots[self._slot(table, item.start_pos + j)] = tok
        sampled = {}
        for item in out.scheduled:
            if item.sample:
                end = item.start_pos + item.num_new_tokens
                full, windowed = item.block_tables
                context = [self.slots[self._slot(full, p)] for p in range(end)]
                recent = [self.slots[self._slot(windowed, p)] for p in range(max(end - WINDOW, 0), end)]
                sampled[item.request.request_id] = [(next_token(context) + 7 * next_token(recent)) % VOCAB]
        return sampled


def hybrid_scheduler(num_blocks: int, hybrid: bool = True, **config) -> Scheduler:
    kv = KVCacheManager(num_blocks, 16, True, (0, WINDOW) if hybrid else (0, 0))
    settings = dict(max_model_len=1024, max_num_seqs=64, max_num_batched_tokens=2048) | config
    return Scheduler(SchedulerConfig(**settings), kv)


@pytest.mark.parametrize("num_blocks", [512, 28], ids=["roomy", "preempting"])
@pytest.mark.parametrize("budget", [2048, 40], ids=["whole", "chunked"])
def test_a_windowed_group_serves_the_reference_output(num_blocks, budget, assert_scheduler_empty):
    scheduler = hybrid_scheduler(num_blocks, max_num_batched_tokens=budget)
    # Every prompt twice (the second hits the cache), most longer than the window.
    specs = MIXED + MIXED
    requests = [make_request(f"r{i}", prompt(i % len(MIXED), n), max_tokens=m) for i, (n, m) in enumerate(specs)]
    for r in requests:
        scheduler.add_request(r)
    run(scheduler, HybridFakeModel(scheduler.kv_cache))
    for r in requests:
        tokens = list(r.prompt_token_ids)
        for _ in range(r.max_tokens):
            tokens.append(windowed_next_token(tokens))
        assert r.output_token_ids == tokens[r.num_prompt_tokens:], r.request_id
    if num_blocks == 28:
        assert scheduler.num_preemptions_total > 0
    else:
        assert scheduler.num_preemptions_total == 0 and any(r.num_cached_tokens for r in requests[len(MIXED):])
    assert_scheduler_empty(scheduler)


def test_a_windowed_group_holds_more_long_sequences():
    # Eight prompts of 600 tokens: with every block kept each holds 2 x 38 blocks; the
    # windowed group's share shrinks to its window once the prompt has run.
    peak = {}
    for hybrid in (True, False):
        scheduler = hybrid_scheduler(400, hybrid, max_num_batched_tokens=600)
        for i in range(8):
            scheduler.add_request(make_request(f"r{i}", prompt(i, 600), max_tokens=40))
        model, peak[hybrid] = HybridFakeModel(scheduler.kv_cache), 0
        while scheduler.has_unfinished_requests():
            out = scheduler.schedule()
            peak[hybrid] = max(peak[hybrid], scheduler.num_running)
            scheduler.update_from_output(out, model.step(out))
    assert peak[False] == 5 and peak[True] == 8

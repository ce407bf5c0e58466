"""AsyncEngine on the real default model: many streams, cancellation, faults, rejection.

Each test runs its own event loop (``asyncio.run``) and its own engine on the
shared weights. Every wait has a timeout, so a lost delta fails the test
instead of hanging it.
"""

from __future__ import annotations

import asyncio
import collections
import threading

import pytest

from engine.async_engine import AsyncEngine, EngineDeadError
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model_runner import kv_bytes_per_block
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.stats import StepStats

pytestmark = pytest.mark.slow


BLOCK_SIZE = 16
MAX_MODEL_LEN = 256
TIMEOUT = 60  # seconds for any one wait; generous for a loaded 2-core machine


def make_async_engine(loaded, **overrides) -> AsyncEngine:
    """An engine on the shared weights; its loop is left to the test's ``run_loop`` call."""
    budget = 128 * kv_bytes_per_block(loaded.config, loaded.dtype, BLOCK_SIZE)
    settings = dict(dtype="float32", device="cpu", kv_cache_memory=budget, block_size=BLOCK_SIZE,
                    max_model_len=MAX_MODEL_LEN, kv_cache_dtype="float32")
    settings.update(overrides)
    return AsyncEngine(LLMEngine(EngineConfig(**settings), loaded=loaded))


def start_loop_thread(engine: AsyncEngine) -> threading.Thread:
    """Run the engine loop on a thread of its own (it begins once ``start()`` binds the event loop)."""
    thread = threading.Thread(target=engine.run_loop, name="test-engine-loop", daemon=True)
    thread.start()
    return thread


class StatsRecorder:
    def __init__(self) -> None:
        self.steps: list[StepStats] = []

    def record(self, stats: StepStats) -> None:  # called on the engine thread
        self.steps.append(stats)


async def collect(stream) -> list[RequestOutput]:
    """Every delta of a stream until it ends."""
    return [out async for out in stream]


async def wait_until(condition, timeout: float) -> bool:
    """Poll ``condition`` until it holds or ``timeout`` seconds pass."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


def test_cancelled_streams_free_their_blocks_and_the_rest_complete(smollm2_loaded):
    tok = smollm2_loaded.tokenizer
    params = SamplingParams(temperature=0, max_tokens=6)
    prompts = {f"req-{i}": tok.encode(f"Fact number {i} about the ocean:") for i in range(50)}
    closed = {f"req-{i}" for i in range(0, 50, 10)}  # aclose() after the first delta
    cancelled = {f"req-{i}" for i in range(5, 50, 10)}  # the consuming task cancelled after the first delta

    async def close_after_first(engine: AsyncEngine, rid: str) -> RequestOutput:
        stream = engine.generate(rid, prompts[rid], params)
        first = await anext(stream)
        await stream.aclose()
        return first

    async def consume_forever(engine: AsyncEngine, rid: str, started: asyncio.Event) -> None:
        async for _ in engine.generate(rid, prompts[rid], params):
            started.set()

    async def scenario() -> None:
        engine = make_async_engine(smollm2_loaded)
        recorder = StatsRecorder()
        engine.add_stat_logger(recorder)
        start_loop_thread(engine)
        await engine.start()
        try:
            completing = {rid: asyncio.create_task(collect(engine.generate(rid, prompts[rid], params)))
                          for rid in prompts if rid not in closed | cancelled}
            closing = [asyncio.create_task(close_after_first(engine, rid)) for rid in sorted(closed)]
            started = {rid: asyncio.Event() for rid in cancelled}
            consumers = {rid: asyncio.create_task(consume_forever(engine, rid, started[rid])) for rid in cancelled}
            for rid, task in consumers.items():
                await asyncio.wait_for(started[rid].wait(), TIMEOUT)
                task.cancel()

            firsts = await asyncio.wait_for(asyncio.gather(*closing), TIMEOUT)
            results = await asyncio.wait_for(asyncio.gather(*completing.values()), TIMEOUT)
            for task in consumers.values():
                with pytest.raises(asyncio.CancelledError):
                    await task

            assert all(not first.finished for first in firsts), "closed before the end: must be an abort"
            assert len(results) == 40
            for outs in results:
                assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
                assert all(o.error is None for o in outs)
                assert outs[-1].outputs[0].finish_reason in ("length", "stop")
                assert 1 <= sum(len(o.outputs[0].token_ids) for o in outs) <= 6

            inner = engine.engine
            assert await wait_until(lambda: engine.num_unfinished_requests == 0
                                    and not inner.has_unfinished_requests()
                                    and inner.kv_cache.stats.num_blocks_used == 0, timeout=TIMEOUT)
            assert engine.is_alive
            reasons = collections.Counter(f.finish_reason for s in recorder.steps for f in s.finished)
            assert reasons["abort"] == 10
            assert reasons["length"] + reasons["stop"] == 40
        finally:
            await asyncio.wait_for(engine.shutdown(), TIMEOUT)
        assert not engine.is_alive

    asyncio.run(scenario())


def test_engine_fault_fails_every_in_flight_request(smollm2_loaded, monkeypatch):
    tok = smollm2_loaded.tokenizer
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def scenario() -> None:
        engine = make_async_engine(smollm2_loaded)
        start_loop_thread(engine)
        await engine.start()
        try:
            streams = [engine.generate(f"fault-{i}", tok.encode(f"Story {i}: once upon a time"), params)
                       for i in range(3)]
            firsts = [await asyncio.wait_for(anext(s), TIMEOUT) for s in streams]
            assert not any(f.finished for f in firsts)

            runner = engine.engine.runner
            real_execute = runner.execute
            faults = []

            def execute_failing_once(batch):
                if not faults:
                    faults.append(batch)
                    raise RuntimeError("simulated device fault")
                return real_execute(batch)

            monkeypatch.setattr(runner, "execute", execute_failing_once)

            for stream in streams:
                rest = await asyncio.wait_for(collect(stream), TIMEOUT)
                assert rest and all(o.error is None for o in rest[:-1])
                assert rest[-1].finished
                assert "simulated device fault" in rest[-1].error
            assert len(faults) == 1
            assert await wait_until(lambda: not engine.is_alive, timeout=TIMEOUT)
            with pytest.raises(EngineDeadError):
                await anext(engine.generate("after", tok.encode("Hello"), params))
        finally:
            await asyncio.wait_for(engine.shutdown(), TIMEOUT)

    asyncio.run(scenario())


def test_request_that_can_never_fit_raises_value_error(smollm2_loaded):
    async def scenario() -> None:
        engine = make_async_engine(smollm2_loaded)
        start_loop_thread(engine)
        await engine.start()
        try:
            with pytest.raises(ValueError, match=r"\b250\b"):
                engine.generate("too-long", [42] * 250, SamplingParams(temperature=0, max_tokens=17))
            assert engine.num_unfinished_requests == 0
            assert engine.is_alive
            # The engine still serves requests that fit.
            outs = await asyncio.wait_for(
                collect(engine.generate("fits", [42] * 10, SamplingParams(temperature=0, max_tokens=2))), TIMEOUT)
            assert outs[-1].finished and outs[-1].error is None
        finally:
            await asyncio.wait_for(engine.shutdown(), TIMEOUT)

    asyncio.run(scenario())


def test_shutdown_ends_in_flight_streams(smollm2_loaded):
    tok = smollm2_loaded.tokenizer

    async def scenario() -> None:
        engine = make_async_engine(smollm2_loaded)
        start_loop_thread(engine)
        await engine.start()
        stream = engine.generate("long", tok.encode("Once upon a time"),
                                 SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        first = await asyncio.wait_for(anext(stream), TIMEOUT)
        assert not first.finished

        await asyncio.wait_for(engine.shutdown(), TIMEOUT)

        rest = await asyncio.wait_for(collect(stream), TIMEOUT)
        assert rest[-1].finished
        assert rest[-1].error is not None or rest[-1].outputs[0].finish_reason == "abort"
        assert not engine.is_alive
        with pytest.raises(EngineDeadError):
            await anext(engine.generate("after", tok.encode("Hello"), SamplingParams(max_tokens=2)))

    asyncio.run(scenario())


def test_request_arriving_as_the_engine_dies_fails_instead_of_hanging(smollm2_loaded, monkeypatch):
    # The fault lands after the stream saw a live engine but before its request
    # was registered: is_alive answers True, and the loop dies right after.
    tok = smollm2_loaded.tokenizer
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def scenario() -> None:
        engine = make_async_engine(smollm2_loaded)
        loop_thread = start_loop_thread(engine)
        await engine.start()
        inner = engine.engine
        real_is_alive = AsyncEngine.is_alive.fget

        def fail_the_engine(*_):
            raise RuntimeError("simulated device fault")

        def alive_then_dies(self) -> bool:
            alive = real_is_alive(self)
            monkeypatch.setattr(inner.runner, "execute", fail_the_engine)
            loop_thread.join(TIMEOUT)  # the in-flight request's next step kills the loop
            return alive

        try:
            running = engine.generate("running", tok.encode("Once upon a time"), params)
            await asyncio.wait_for(anext(running), TIMEOUT)
            late = engine.generate("late", tok.encode("Hello there"), params)
            monkeypatch.setattr(AsyncEngine, "is_alive", property(alive_then_dies))
            try:
                outs = await asyncio.wait_for(collect(late), 10)
            except EngineDeadError:
                pass
            else:
                assert outs[-1].finished and outs[-1].error is not None
            monkeypatch.undo()
            assert not engine.is_alive
            rest = await asyncio.wait_for(collect(running), TIMEOUT)
            assert rest[-1].error is not None
        finally:
            await asyncio.wait_for(engine.shutdown(), TIMEOUT)

    asyncio.run(scenario())


def test_abort_that_leaves_the_engine_idle_still_reaches_the_stat_loggers(smollm2_loaded):
    tok = smollm2_loaded.tokenizer

    async def scenario() -> None:
        engine = make_async_engine(smollm2_loaded)
        recorder = StatsRecorder()
        engine.add_stat_logger(recorder)
        start_loop_thread(engine)
        await engine.start()
        try:
            stream = engine.generate("gone", tok.encode("Once upon a time"),
                                     SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
            await asyncio.wait_for(anext(stream), TIMEOUT)
            await stream.aclose()

            def abort_reported() -> bool:
                return any(f.finish_reason == "abort" for s in list(recorder.steps) for f in s.finished)

            assert await wait_until(abort_reported, timeout=TIMEOUT)
            last = recorder.steps[-1]
            assert last.kv_blocks_used == 0 and last.num_running == 0 and last.num_waiting == 0
        finally:
            await asyncio.wait_for(engine.shutdown(), TIMEOUT)

    asyncio.run(scenario())


def test_loop_serves_from_the_calling_thread_and_stops_on_shutdown(smollm2_loaded):
    """The server's layout: the engine loop on this thread, the event loop on another."""
    engine = make_async_engine(smollm2_loaded)
    results: dict[str, object] = {}

    async def client() -> None:
        await engine.start()
        outs = await asyncio.wait_for(
            collect(engine.generate("h0", [1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=4))),
            TIMEOUT)
        results["tokens"] = [t for o in outs for c in o.outputs for t in c.token_ids]
        results["alive"] = engine.is_alive
        await engine.shutdown()

    loop_thread = threading.Thread(target=lambda: asyncio.run(client()))
    loop_thread.start()
    engine.run_loop()  # returns once shutdown() stops the loop
    loop_thread.join(TIMEOUT)

    assert not loop_thread.is_alive()
    assert len(results["tokens"]) == 4 and results["alive"] is True
    assert not engine.is_alive
    assert engine.engine.kv_cache.stats.num_blocks_used == 0


def test_loop_gives_up_when_the_http_side_never_starts(smollm2_loaded):
    engine = make_async_engine(smollm2_loaded)
    give_up = threading.Event()
    give_up.set()

    engine.run_loop(give_up=give_up)  # must return, not wait forever

    assert not engine.is_alive

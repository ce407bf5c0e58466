"""The engine loop on its own thread, with per-request async streams.

The HTTP event loop never runs model code: it hands requests to the engine
thread (the one that calls ``AsyncEngine.run_loop``) through a thread-safe
queue and receives deltas through per-request ``asyncio.Queue``s filled with
``call_soon_threadsafe``. An idle engine blocks on its command queue, so it
costs no CPU.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.request import EngineRequest
from engine.sampling_params import SamplingParams
from engine.stats import StatLogger
from engine.validation import InvalidRequestError

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop has stopped after a fault; no request can be served."""


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Change:
    """A change of the engine's own state (a LoRA adapter in or out), made on its thread."""

    change: Callable[[], None]
    done: asyncio.Future  # settled on the event loop once the change is made (or refused)


_STOP = object()


class AsyncEngine:
    """Async front of an ``LLMEngine``: per-request streams on the event loop,
    ``step()`` on the thread that calls :meth:`run_loop`.

    NOTE: torch's OpenMP thread pool is fast only on the process's main thread;
    on any other thread each parallel region costs tens of microseconds more
    (measured: a batch-1 decode step 50% slower). The server therefore runs
    :meth:`run_loop` on the main thread and uvicorn's event loop on a helper
    thread.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self.sampling_defaults = engine.sampling_defaults
        self.sampling_overrides = engine.sampling_overrides
        self.num_kv_blocks = engine.num_blocks
        self.block_size = engine.block_size
        # Read by the server, changed by the engine thread (load_adapter, unload_adapter).
        self.lora_adapters = engine.lora_adapters
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead: BaseException | None = None
        self.last_step_time: float | None = None
        self._bound = threading.Event()  # start() has bound the event loop
        self._loop_done = threading.Event()  # run_loop() has returned
        engine.add_fault_listener(self._lost_rank)

    # -- state ------------------------------------------------------------

    # A loop with work that has not finished a step for this long is stuck.
    STALL_SECONDS = 60.0

    @property
    def is_alive(self) -> bool:
        """True while the loop runs; False before start and after a fault or shutdown."""
        return self._dead is None and self._bound.is_set() and not self._loop_done.is_set()

    @property
    def is_ready(self) -> bool:
        """Alive and making progress: idle, or a step finished within ``STALL_SECONDS``."""
        if not self.is_alive:
            return False
        if not self._streams or self.last_step_time is None:
            return True
        return time.monotonic() - self.last_step_time < self.STALL_SECONDS

    @property
    def num_unfinished_requests(self) -> int:
        """Requests accepted and not yet finished (waiting or running)."""
        return len(self._streams)

    def add_stat_logger(self, stat_logger: StatLogger) -> None:
        """Receive each step's ``StepStats`` (called on the engine thread)."""
        self.engine.stat_loggers.append(stat_logger)

    # -- lifecycle --------------------------------------------------------

    def run_loop(self, give_up: "threading.Event | None" = None) -> None:
        """Run the engine loop on the calling thread until shutdown (blocks).

        Waits for :meth:`start` first; returns early if ``give_up`` is set
        before that (the HTTP server failed to start).
        """
        while not self._bound.wait(0.2):
            if give_up is not None and give_up.is_set():
                return
        try:
            self._run()
        finally:
            self._loop_done.set()

    async def start(self) -> None:
        """Bind the event loop that will consume outputs; call from that loop."""
        if self._bound.is_set():
            return
        self._loop = asyncio.get_running_loop()
        self._bound.set()

    async def shutdown(self) -> None:
        """Abort everything and stop the loop."""
        if not self._bound.is_set():
            return
        for rid in list(self._streams):
            self._commands.put(_Abort(rid))
        self._commands.put(_STOP)
        await asyncio.to_thread(self._loop_done.wait, 30)
        if self._dead is None:
            self._dead = EngineDeadError("the engine was shut down")
        self._fail_all("the engine was shut down")

    # -- requests ---------------------------------------------------------

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 group: str | None = None, adapter: str | None = None) -> AsyncIterator[RequestOutput]:
        """Check a request and return the stream of its deltas.

        Requests of one ``group`` (default: the request alone) take turns with
        other groups for admission; ``adapter`` names the LoRA adapter to run
        (None: the base model). Raises ``InvalidRequestError`` (a
        ``ValueError``) at once if the request can never run. The request
        enters the engine when the stream is first iterated, which raises
        ``EngineDeadError`` if the engine is dead; closing or cancelling the
        stream aborts the request and frees its KV blocks.
        """
        return self._stream(self.engine.prepare(request_id, prompt_token_ids, params, group=group,
                                                adapter=adapter))

    async def _stream(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        request_id = request.request_id
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        self._commands.put(request)
        if self._dead is not None:
            # NOTE: the loop died after the check above and may have
            # failed its streams before this one was registered: nothing would
            # ever arrive.
            self._streams.pop(request_id, None)
            raise EngineDeadError("the engine is not running")
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._commands.put(_Abort(request_id))

    async def load_adapter(self, name: str, path: str) -> None:
        """Serve the LoRA adapter at ``path`` as model ``name`` from now on. Its weights
        are read on a worker thread; the engine loop only takes them in.
        ``InvalidRequestError`` naming ``lora_name`` for a name in use (checked before the
        files are read) and ``lora_path`` for a bad adapter; not with tensor parallelism
        (the other ranks hold the adapters of the start-up only)."""
        if self.engine.workers is not None:
            raise InvalidRequestError("LoRA adapters cannot be loaded while serving with tensor parallelism",
                                      "lora_path")
        taken = InvalidRequestError(f"The model '{name}' is already served.", "lora_name")
        if name in self.lora_adapters or name == self.model_name:
            raise taken
        try:
            adapter = await asyncio.to_thread(self.engine.read_adapter, name, path)
        except ValueError as e:
            raise InvalidRequestError(str(e), "lora_path") from None
        try:
            await self._on_engine_thread(lambda: self.engine.install_adapter(adapter, path))
        except ValueError:  # loaded under that name meanwhile
            raise taken from None

    async def unload_adapter(self, name: str) -> None:
        """Stop serving LoRA adapter ``name``: new requests for it are refused, running
        ones finish on it. ``ValueError`` if none has that name."""
        await self._on_engine_thread(lambda: self.engine.remove_adapter(name))

    async def _on_engine_thread(self, change: Callable[[], None]) -> None:
        """Run ``change`` on the engine loop's thread, between steps; its error is raised here."""
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        done: asyncio.Future = asyncio.get_running_loop().create_future()
        self._commands.put(_Change(change, done))
        if self._dead is not None:  # died meanwhile: the change may never be made
            raise EngineDeadError("the engine is not running")
        await done

    def abort_all(self) -> None:
        """Abort every unfinished request now (a drain that ran out of time): each
        stream ends with a ``finish_reason="abort"`` delta and the blocks are freed."""
        for rid in list(self._streams):
            self._commands.put(_Abort(rid))

    # -- the loop (engine thread) -----------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                block = not engine.has_unfinished_requests()
                if not self._drain(block):
                    return
                if not engine.has_unfinished_requests():
                    if not block:
                        # Aborts just emptied the engine: an empty step reports
                        # them and the freed blocks to the stat loggers now.
                        engine.step()
                    continue
                if self.last_step_time is None or block:
                    # Work just arrived after idling: measure stalls from now.
                    self.last_step_time = time.monotonic()
                outputs = engine.step()
                self.last_step_time = time.monotonic()
                for out in outputs:
                    self._deliver(out.request_id, out)
        except BaseException as exc:  # noqa: BLE001 - any fault must fail the requests, not hang them
            logger.exception("engine loop failed")
            self._dead = exc
            self._fail_all(f"engine fault: {type(exc).__name__}: {exc}")

    def _drain(self, block: bool) -> bool:
        """Apply queued adds/aborts; wait for one when idle. False on shutdown."""
        try:
            # A timed wait while idle: the main thread must wake now and then
            # for Python to run signal handlers (SIGTERM) when it hosts the loop.
            cmd = self._commands.get(block=block, timeout=0.5 if block else None)
        except queue.Empty:
            return True
        while True:
            if cmd is _STOP:
                return False
            if isinstance(cmd, EngineRequest):
                try:
                    self.engine.add(cmd)
                except ValueError as exc:  # an id already in use
                    self._deliver(cmd.request_id, exc)
            elif isinstance(cmd, _Change):
                self._apply(cmd)
            else:
                self._abort_now(cmd.request_id)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, cmd: "_Change") -> None:
        try:
            cmd.change()
        except ValueError as exc:
            self._settle(cmd.done, exc)
        else:
            self._settle(cmd.done, None)

    def _settle(self, done: asyncio.Future, error: BaseException | None) -> None:
        def settle() -> None:
            if not done.done():
                done.set_exception(error) if error is not None else done.set_result(None)

        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(settle)
            except RuntimeError:  # the event loop is closed
                pass

    def _abort_now(self, request_id: str) -> None:
        final = self.engine.abort_request(request_id)
        if final is not None:
            self._deliver(request_id, final)

    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is None or self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(stream.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _lost_rank(self, message: str) -> None:
        # The watchdog's thread: the loop may be blocked in a collective with the lost
        # rank, so fail the requests and turn unhealthy from here, now.
        self._dead = EngineDeadError(message)
        self._fail_all(f"engine fault: {message}")

    def _fail_all(self, message: str) -> None:
        for rid in list(self._streams):
            self._deliver(rid, RequestOutput(rid, [], [], finished=True, error=message))
        # Changes still queued will never be made: their callers must not wait forever.
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Change):
                self._settle(cmd.done, EngineDeadError(message))

"""Tensor-parallel ranks: their processes, the step broadcast and the watchdog.

Rank 0 is the serving process: it alone schedules, samples and answers HTTP.
Before each forward it broadcasts the step (the chunks: token ids, positions,
block ids, how many rows to sample) to the other ranks, which run the same
forward on their slices of the model (``models.parallel``) and their own KV
heads, and join its all-reduces. The block tables are rank 0's, so every
rank's cache holds the same blocks.

Everything travels as int64 tensors over ``torch.distributed`` (gloo on a CPU,
NCCL on CUDA): no pickle between ranks. The rendezvous is a ``TCPStore`` at
``master_addr:master_port`` (hosted by rank 0, or by ``torchrun``'s agent).

Faults: each rank bumps a heartbeat counter in the store every
``HEARTBEAT_SECONDS``; rank 0's watchdog thread declares a rank lost when its
process has exited (ranks on this host) or its counter has not moved for
``HEARTBEAT_TIMEOUT_SECONDS`` (any host: a frozen or unreachable rank). Then it
kills the ranks of this host (so a forward waiting on them fails at once
instead of at the collective's timeout) and tells the engine, which fails its
requests and reports unhealthy. A rank exits when rank 0's store goes away, and
a rank started here also when this process dies (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from engine.config import EngineConfig, torchrun_rank
from engine.model_runner import Chunk, ModelRunner
from models.kv_cache import model_layout, resolve_dtype
from models.loader import read_config, resolve_device, resolve_path
from models.parallel import TensorParallel, check_split

logger = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 0.5
HEARTBEAT_TIMEOUT_SECONDS = 5.0
# How long a collective may wait for a peer (gloo's own timeout). Generous: ranks
# load the model between two of them; a lost rank is found by the watchdog first.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
# How long rank 0 waits for every rank to reach the rendezvous.
JOIN_TIMEOUT_SECONDS = 300.0

_OP_STOP, _OP_RUN, _OP_NUM_BLOCKS = 0, 1, 2
_PREFIX = "kvserve/"


@dataclass(frozen=True)
class RankSpec:
    """What a rank needs to load its slice: the path rank 0 resolved (every rank must
    run the same dtype and quantization) and where to meet."""

    model: str
    dtype: str
    quantization: str
    device: str
    max_positions: int | None
    kv_cache_dtype: str
    block_size: int
    world_size: int
    ranks_per_node: int
    master_addr: str
    master_port: int
    # The LoRA adapters, [name, path] each: every rank loads its part of each; a step
    # names a chunk's adapter by its place in this list.
    lora_modules: list[list[str]] = dataclasses.field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "RankSpec":
        return cls(**json.loads(text))


def rank_spec(config: EngineConfig) -> RankSpec:
    """Resolve ``config``'s path (``auto`` is measured here, once, on rank 0's host) and
    check the split; ``ValueError`` naming the numbers if the model cannot be split."""
    par = config.parallel
    # A split model runs dequantised or requantised weights (gguf_native's own codes are not split).
    model_config, gguf_type, _ = read_config(config.model)
    device = resolve_device(config.device)
    dtype, quantization = resolve_path(config.dtype, config.quantization, model_config, gguf_type, device)
    check_split(model_config, par.tensor_parallel_size, quantized=quantization != "none")
    kv_dtype = resolve_dtype(config.kv_cache_dtype, dtype)
    return RankSpec(model=config.model, dtype=str(dtype).removeprefix("torch."), quantization=quantization,
                    device=config.device, max_positions=config.max_model_len,
                    kv_cache_dtype=str(kv_dtype).removeprefix("torch."), block_size=config.block_size,
                    world_size=par.tensor_parallel_size, ranks_per_node=par.ranks_per_node,
                    master_addr=par.master_addr, master_port=par.master_port,
                    lora_modules=[[m.name, m.path] for m in config.lora_modules])


# -- the step on the wire ---------------------------------------------------


_HEAD = 5  # ints per chunk before the bodies


def _encode(chunks: list[Chunk], adapters: list[str]) -> torch.Tensor:
    """``[len, start, blocks, sampled, adapter] * n`` (``adapter``: 1 + its place in
    ``adapters``, 0 for none), then each chunk's tokens and block tables (one per group
    of the cache's layout, each ``blocks`` long)."""
    head: list[int] = []
    body: list[int] = []
    for c in chunks:
        adapter = adapters.index(c.adapter) + 1 if c.adapter is not None else 0
        head += [len(c.token_ids), c.start_pos, len(c.block_tables[0]), c.num_sampled, adapter]
        body += c.token_ids
        for table in c.block_tables:
            body += table
    return torch.tensor(head + body, dtype=torch.long)


def _decode(n: int, flat: list[int], adapters: list[str], groups: int) -> list[Chunk]:
    chunks, at = [], _HEAD * n
    for i in range(n):
        length, start, blocks, sampled, adapter = flat[_HEAD * i:_HEAD * (i + 1)]
        tokens = flat[at:at + length]
        at += length
        tables = [flat[at + g * blocks:at + (g + 1) * blocks] for g in range(groups)]
        chunks.append(Chunk(tokens, start, tables, sampled, adapters[adapter - 1] if adapter else None))
        at += groups * blocks
    return chunks


def _broadcast_header(op: int, n: int, size: int, device: torch.device) -> None:
    dist.broadcast(torch.tensor([op, n, size], dtype=torch.long, device=device), src=0)


def _receive(device: torch.device) -> tuple[int, int, torch.Tensor | None]:
    header = torch.empty(3, dtype=torch.long, device=device)
    dist.broadcast(header, src=0)
    op, n, size = header.tolist()
    if size == 0:
        return op, n, None
    payload = torch.empty(size, dtype=torch.long, device=device)
    dist.broadcast(payload, src=0)
    return op, n, payload


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _comm_device(device: torch.device) -> torch.device:
    """Where the step tensors go: NCCL moves only CUDA tensors."""
    return device if device.type == "cuda" else torch.device("cpu")


def _threads_per_rank(ranks_here: int) -> int:
    return max(1, (os.cpu_count() or 1) // ranks_here)


# -- rank 0 -----------------------------------------------------------------


class WorkerGroup:
    """Rank 0's side: the ranks it started, the step broadcast and the watchdog."""

    def __init__(self, spec: RankSpec, store: dist.Store, procs: list[subprocess.Popen],
                 device: torch.device) -> None:
        self.spec = spec
        self._adapters = [name for name, _ in spec.lora_modules]  # a chunk's adapter goes by its place here
        self._store = store
        self._procs = procs
        self._device = _comm_device(device)
        self._fault: str | None = None
        self._listeners: list[Callable[[str], None]] = []
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._watchdog = threading.Thread(target=self._watch, name="kvserve-tp-watchdog", daemon=True)

    @classmethod
    def start(cls, config: EngineConfig) -> tuple["WorkerGroup", RankSpec, TensorParallel]:
        """Start this host's other ranks and meet every rank; returns the group, the
        resolved spec to load rank 0's slice with, and rank 0's ``TensorParallel``."""
        spec = rank_spec(config)
        device = resolve_device(spec.device)
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = dist.TCPStore(spec.master_addr, spec.master_port, spec.world_size, is_master=not agent_store,
                              wait_for_workers=False, timeout=COLLECTIVE_TIMEOUT)
        if spec.master_port == 0:
            spec = dataclasses.replace(spec, master_port=store.port)
        procs = [] if torchrun_rank() is not None else _spawn(spec, range(1, spec.ranks_per_node))
        group = cls(spec, store, procs, device)
        try:
            group._join()
            torch.set_num_threads(_threads_per_rank(spec.ranks_per_node))
            _bind_cpus(0, spec.ranks_per_node)
            dist.init_process_group(_backend(device), store=dist.PrefixStore("pg", store), rank=0,
                                    world_size=spec.world_size, timeout=COLLECTIVE_TIMEOUT)
        except BaseException:
            group._kill()
            raise
        logger.info("tensor parallel: %d ranks (%d here), rendezvous %s:%d, %s", spec.world_size,
                    spec.ranks_per_node, spec.master_addr, spec.master_port, _backend(device))
        return group, spec, TensorParallel(0, spec.world_size)

    def _join(self) -> None:
        """Wait until every other rank has reached the store; fail early if one exits."""
        deadline = time.monotonic() + JOIN_TIMEOUT_SECONDS
        need = self.spec.world_size - 1
        while self._store.add(_PREFIX + "joined", 0) < need:
            for rank, p in enumerate(self._procs, start=1):
                if p.poll() is not None:
                    raise RuntimeError(f"tensor parallel rank {rank} exited with status {p.returncode} "
                                       "before joining (its log is above)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {self._store.add(_PREFIX + 'joined', 0)} of {need} tensor parallel "
                                   f"ranks reached {self.spec.master_addr}:{self.spec.master_port} within "
                                   f"{JOIN_TIMEOUT_SECONDS:.0f} s")
            time.sleep(0.05)

    def set_num_blocks(self, num_blocks: int, max_model_len: int, hybrid: bool) -> None:
        """Tell every rank how many KV blocks to allocate (after each has loaded its slice)
        and how its layers group (``models.kv_cache.model_layout``'s last two arguments)."""
        _broadcast_header(_OP_NUM_BLOCKS, num_blocks, 2, self._device)
        dist.broadcast(torch.tensor([max_model_len, int(hybrid)], dtype=torch.long, device=self._device), src=0)
        self._watchdog.start()

    def broadcast_step(self, chunks: list[Chunk]) -> None:
        """Send one forward's chunks to every rank (called just before rank 0's forward)."""
        if self._fault is not None:
            raise RuntimeError(self._fault)
        payload = _encode(chunks, self._adapters).to(self._device)
        _broadcast_header(_OP_RUN, len(chunks), payload.numel(), self._device)
        dist.broadcast(payload, src=0)

    def forward_failed(self, exc: RuntimeError) -> RuntimeError:
        """A forward failed in a collective: give the watchdog a moment to name the lost
        rank, and say that (else the collective's own error)."""
        deadline = time.monotonic() + 2 * HEARTBEAT_SECONDS
        while self._fault is None and time.monotonic() < deadline:
            self._check_processes()
            time.sleep(0.05)
        return RuntimeError(self._fault or f"tensor parallel collective failed: {exc}")

    # -- faults ---------------------------------------------------------

    @property
    def fault(self) -> str | None:
        """Why the group is broken (a rank lost), or None."""
        return self._fault

    def add_fault_listener(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(message)`` (on the watchdog's thread) when a rank is lost."""
        self._listeners.append(listener)

    def _watch(self) -> None:
        store = dist.TCPStore(self.spec.master_addr, self.spec.master_port, is_master=False,
                              timeout=timedelta(seconds=HEARTBEAT_TIMEOUT_SECONDS))
        ranks = range(1, self.spec.world_size)
        last = {r: (-1, time.monotonic()) for r in ranks}
        while not self._stopped.wait(HEARTBEAT_SECONDS):
            if self._check_processes():
                return
            problem = None
            now = time.monotonic()
            for r in ranks:
                if problem is not None:
                    break
                try:
                    beat = store.add(f"{_PREFIX}heartbeat/{r}", 0)
                except Exception as exc:  # noqa: BLE001 - an unreachable store is a lost group
                    problem = f"tensor parallel store unreachable: {exc}"
                    break
                if beat != last[r][0]:
                    last[r] = (beat, now)
                elif now - last[r][1] > HEARTBEAT_TIMEOUT_SECONDS:
                    problem = f"tensor parallel rank {r} sent no heartbeat for {now - last[r][1]:.0f} s"
            if problem is not None:
                self._lose(problem)
                return

    def _check_processes(self) -> bool:
        """Whether a rank started here has exited (then the group is lost)."""
        for rank, p in enumerate(self._procs, start=1):
            if p.poll() is not None:
                self._lose(f"tensor parallel rank {rank} exited with status {p.returncode}")
                return True
        return False

    def _lose(self, message: str) -> None:
        with self._lock:
            if self._fault is not None or self._stopped.is_set():  # stopping: ranks exit on purpose
                return
            self._fault = message
        logger.error("%s: stopping every rank", message)
        # A forward blocked in a collective with a lost rank fails at once when the
        # ranks here are gone, not at the collective's timeout.
        self._kill()
        for listener in self._listeners:
            listener(message)

    # -- shutdown ---------------------------------------------------------

    def shutdown(self) -> None:
        """Stop every rank: a stop message when the group is healthy, then kill what is left."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self._fault is None:
            try:
                _broadcast_header(_OP_STOP, 0, 0, self._device)
            except Exception:  # noqa: BLE001 - a rank already gone: killed below
                pass
        deadline = time.monotonic() + 5.0
        for p in self._procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self._kill()
        if dist.is_initialized() and self._fault is None:
            dist.destroy_process_group()

    def _kill(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                p.kill()
        for p in self._procs:
            p.wait()


def _spawn(spec: RankSpec, ranks: range) -> list[subprocess.Popen]:
    """Start ranks of this host as ``python -m engine.workers`` processes."""
    procs = []
    for rank in ranks:
        cmd = [sys.executable, "-m", "engine.workers", "--rank", str(rank), "--spec", spec.to_json()]
        procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL))
    return procs


def _bind_cpus(local_rank: int, ranks_here: int) -> None:
    """Give each rank of this host its own cores, when there are enough to share out."""
    cpus = sorted(os.sched_getaffinity(0))
    per = len(cpus) // ranks_here
    if per >= 1 and len(cpus) >= ranks_here and len(cpus) % ranks_here == 0:
        os.sched_setaffinity(0, cpus[local_rank * per:(local_rank + 1) * per])


# -- the other ranks --------------------------------------------------------


def run_rank(spec: RankSpec, rank: int) -> None:
    """Load this rank's slice and run forwards as rank 0 sends them, until it says stop."""
    from models.loader import load_model  # noqa: PLC0415
    from models.lora import load_adapter  # noqa: PLC0415

    local_rank = rank % spec.ranks_per_node
    store = dist.TCPStore(spec.master_addr, spec.master_port, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    _start_heartbeat(spec, rank)
    store.add(_PREFIX + "joined", 1)
    torch.set_num_threads(_threads_per_rank(spec.ranks_per_node))
    _bind_cpus(local_rank, spec.ranks_per_node)
    device = resolve_device(spec.device)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    dist.init_process_group(_backend(device), store=dist.PrefixStore("pg", store), rank=rank,
                            world_size=spec.world_size, timeout=COLLECTIVE_TIMEOUT)
    tp = TensorParallel(rank, spec.world_size)
    loaded = load_model(spec.model, spec.dtype, str(device), max_positions=spec.max_positions,
                        quantization=spec.quantization, tp=tp)
    comm = _comm_device(device)
    op, num_blocks, shape = _receive(comm)
    if op != _OP_NUM_BLOCKS or shape is None:
        return
    max_model_len, hybrid = shape.tolist()
    cfg = loaded.config
    layout = model_layout(cfg, max_model_len, bool(hybrid))
    runner = ModelRunner(loaded, num_blocks, spec.block_size, getattr(torch, spec.kv_cache_dtype), layout=layout)
    for name, path in spec.lora_modules:
        runner.adapters[name] = load_adapter(name, path, loaded.config, loaded.dtype, loaded.device, tp=tp)
    logger.info("rank %d ready: %d KV blocks", rank, num_blocks)
    names = [name for name, _ in spec.lora_modules]
    while True:
        op, n, payload = _receive(comm)
        if op != _OP_RUN:
            break
        runner.run(_decode(n, payload.tolist(), names, layout.num_groups))
    dist.destroy_process_group()


def _start_heartbeat(spec: RankSpec, rank: int) -> None:
    """Bump this rank's counter in rank 0's store; exit when the store is gone (rank 0 died)."""
    store = dist.TCPStore(spec.master_addr, spec.master_port, is_master=False,
                          timeout=timedelta(seconds=HEARTBEAT_TIMEOUT_SECONDS))

    def beat() -> None:
        while True:
            try:
                store.add(f"{_PREFIX}heartbeat/{rank}", 1)
            except Exception:  # noqa: BLE001 - rank 0 is gone: nothing left to serve
                os._exit(1)
            time.sleep(HEARTBEAT_SECONDS)

    threading.Thread(target=beat, name="kvserve-heartbeat", daemon=True).start()


def exit_now(status: int) -> NoReturn:
    """Flush and leave without the interpreter's teardown: gloo's threads, destroyed
    there while still joinable, can abort the process ("terminate called without an
    active exception", status -6) after its work is done (seen once in a full test run)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _die_with_parent() -> None:
    """Linux: get SIGKILL when the process that started this one dies."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def run_node(config: EngineConfig) -> NoReturn:
    """A host other than rank 0's (``--node-rank`` > 0): run its ranks until rank 0 stops them."""
    par = config.parallel
    first = par.node_rank * par.ranks_per_node
    # The path is resolved here as on rank 0; ``auto`` must pick the same on every host
    # (the same CPU kind): give an explicit --dtype and --quantization across kinds.
    spec = rank_spec(config)
    procs = _spawn(spec, range(first + 1, first + par.ranks_per_node))
    try:
        run_rank(spec, first)
    finally:
        # Rank 0's stop reaches every rank; give this host's others a moment to exit.
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
    exit_now(0)


def run_torchrun_rank(config: EngineConfig, rank: int) -> NoReturn:
    """A rank other than 0 under ``torchrun``: this process is the rank."""
    run_rank(rank_spec(config), rank)
    exit_now(0)


def main(argv: list[str] | None = None) -> int:
    """``python -m engine.workers --rank R --spec JSON``: one rank started by rank 0's host."""
    p = argparse.ArgumentParser(description="a kvserve tensor-parallel rank (started by kvserve serve)")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--spec", required=True, help="RankSpec as JSON")
    args = p.parse_args(argv)
    _die_with_parent()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{args.rank} %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: rank 0 stops us
    run_rank(RankSpec.from_json(args.spec), args.rank)
    exit_now(0)


if __name__ == "__main__":
    sys.exit(main())

"""The ``kvserve`` command: ``serve``, ``generate`` (offline), ``chat`` and ``bench``."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import Any

import uvicorn

from engine.config import KV_CACHE_DTYPES, QUANTIZATIONS, EngineConfig
from engine.sampling_params import SamplingParams

logger = logging.getLogger("kvserve")

_UNITS = {"": 1, "b": 1,
          "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Bytes from ``"512MiB"``, ``"2GiB"``, ``"1.5GB"``, ``"4096"``.

    ``KiB/MiB/GiB/TiB`` are powers of 1024; ``KB/MB/GB/TB`` (and ``K/M/G/T``)
    powers of 1000; a plain number is bytes. Case does not matter.
    """
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise ValueError(f"invalid size {text!r}: use a number with an optional unit "
                         "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 512MiB")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return value


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    p.add_argument("--model", default=d.model,
                   help="model name (smollm2), checkpoint directory or .gguf file")
    p.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default=d.device, help="auto, cpu, cuda or cuda:N")
    p.add_argument("--kv-cache-memory", type=_size_arg, default=d.kv_cache_memory,
                   help="KV cache budget, e.g. 512MiB or 2GiB (default 512MiB)")
    p.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype,
                   choices=KV_CACHE_DTYPES,
                   help="auto: float16 for a float32 model (twice the tokens), else the model's dtype; "
                        "int8: 8-bit codes and a scale per token and head (about 1.9x float16's tokens, "
                        "logits within about 1)")
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length (default: the model's)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--quantization", default=d.quantization, choices=QUANTIZATIONS,
                   help="int4: int4 projections, float activations, for small decode batches (CPU); "
                        "w4a8: int4 weights and int8 activations on AVX512-VNNI, every batch; "
                        "auto (default): w4a8 (int4 without VNNI) for a 4-bit GGUF on CPU, else none")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for all subcommands."""
    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    _add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--api-key", default=os.environ.get("KVSERVE_API_KEY"),
                       help="require 'Authorization: Bearer <key>' (default: $KVSERVE_API_KEY)")
    serve.add_argument("--max-queue", type=int, default=None,
                       help="refuse new requests with 503 once this many are unfinished")
    serve.add_argument("--max-body-size", type=_size_arg, default=4 * 1024**2,
                       help="largest request body (default 4MiB)")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds in-flight requests may run after SIGTERM")
    serve.add_argument("--log-level", default="info")

    gen = sub.add_parser("generate", help="generate offline for one prompt")
    _add_engine_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)

    chat = sub.add_parser("chat", help="chat with a running server in the terminal")
    chat.add_argument("--url", default="http://127.0.0.1:8000")
    chat.add_argument("--api-key", default=os.environ.get("KVSERVE_API_KEY"))
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument("--model", default=None)
    # NOTE: a 135M model rambles at OpenAI's default temperature of 1.0.
    chat.add_argument("--temperature", type=float, default=0.2,
                      help="sampling temperature (default 0.2)")

    bench = sub.add_parser("bench", help="benchmark a running server (kvserve bench serve --help)")
    bench.add_argument("tool", choices=["serve"], help="serve: load generator for an "
                       "OpenAI-compatible server")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="the tool's own arguments")
    return parser


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The ``EngineConfig`` for parsed ``serve``/``generate`` arguments; a bad
    setting exits with its message rather than a traceback."""
    try:
        return EngineConfig(
            model=args.model, dtype=args.dtype, device=args.device,
            kv_cache_memory=args.kv_cache_memory, block_size=args.block_size,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
            served_model_name=getattr(args, "served_model_name", None),
            quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    except ValueError as e:
        raise SystemExit(f"kvserve: error: {e}") from None


class DrainingServer(uvicorn.Server):
    """uvicorn, plus: a signal first flips the app into draining (new requests
    get 503 while in-flight ones finish), and SIGTERM ends with exit status 0
    instead of uvicorn re-raising the signal after its graceful shutdown."""

    def __init__(self, config: uvicorn.Config, on_drain: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_drain = on_drain

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._on_drain()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        sigs = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in sigs}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def _make_server(app: Any, host: str, port: int, shutdown_timeout: float, log_level: str,
                 on_drain: Callable[[], None]) -> DrainingServer:
    """uvicorn lets in-flight requests run up to ``shutdown_timeout`` seconds
    after a signal, then cancels them (which aborts their engine requests)."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=shutdown_timeout)
    return DrainingServer(config, on_drain)


def _cmd_serve(args: argparse.Namespace) -> int:
    from engine.async_engine import AsyncEngine  # imported late: loads torch
    from server.app import build_app

    config = engine_config(args)
    logger.info("loading model %s", config.model)
    try:
        engine = AsyncEngine.from_config(config)
    except ValueError as e:  # a bad model name or setting: say it, no traceback
        raise SystemExit(f"kvserve: error: {e}") from None
    app = build_app(engine, api_key=args.api_key, max_queue=args.max_queue,
                    max_body_size=args.max_body_size, served_model_name=args.served_model_name)
    state = app.state.kvserve
    logger.info("kvserve listening on http://%s:%d (model %s, max_model_len %d, auth %s)",
                args.host, args.port, state.model_name, engine.max_model_len,
                "on" if args.api_key else "off")
    logger.info("KV cache: %d blocks x %d tokens = %d tokens", engine.num_kv_blocks,
                engine.block_size, engine.num_kv_blocks * engine.block_size)

    def drain() -> None:
        state.draining = True

    server = _make_server(app, args.host, args.port, args.shutdown_timeout, args.log_level, drain)
    # The engine loop runs on this (main) thread, where torch's thread pool is
    # fast, and uvicorn on a helper thread (see AsyncEngine.host_loop_on_current_thread).
    engine.host_loop_on_current_thread()
    http_done = threading.Event()

    def serve_http() -> None:
        try:
            server.run()
        finally:
            http_done.set()

    http = threading.Thread(target=serve_http, name="kvserve-http")
    previous = {sig: signal.signal(sig, server.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        http.start()
        engine.run_hosted_loop(give_up=http_done)
        # Signals must still reach uvicorn while it drains: keep waking up.
        while http.is_alive():
            http.join(0.2)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    # uvicorn returns normally after a signal-driven graceful shutdown; a failed
    # start-up (port in use, lifespan error) leaves ``started`` false.
    return 0 if server.started else 1


def _cmd_generate(args: argparse.Namespace) -> int:
    """Offline generation for one prompt through the synchronous ``LLMEngine``."""
    from engine.llm_engine import LLMEngine  # imported late: loads torch

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    except ValueError as e:
        raise SystemExit(f"kvserve: error: {e}") from None
    try:
        llm = LLMEngine.from_config(engine_config(args))
    except ValueError as e:
        raise SystemExit(f"kvserve: error: {e}") from None
    # One list of n samples per prompt.
    [samples] = llm.generate([args.prompt], params, use_tqdm=False)
    for sample in samples:
        print(sample.text)
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    from server.chat_client import ChatSession, run

    session = ChatSession(args.url, api_key=args.api_key, system=args.system, model=args.model,
                          temperature=args.temperature)
    return run(session)


def _cmd_bench(args: argparse.Namespace) -> int:
    # NOTE: imported by name, late: bench/ is a client of any OpenAI-compatible
    # server, not a layer under server/, and only this subcommand needs it.
    tool = importlib.import_module(f"bench.{args.tool}")
    return tool.main(args.args, prog=f"kvserve bench {args.tool}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvserve`` console script."""
    args = build_parser().parse_args(argv)
    # The chat client's screen is the conversation: only warnings go to the log.
    level = "warning" if args.command == "chat" else getattr(args, "log_level", "info")
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    commands = {"serve": _cmd_serve, "generate": _cmd_generate, "chat": _cmd_chat,
                "bench": _cmd_bench}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())

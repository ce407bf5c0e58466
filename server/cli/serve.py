"""``kvserve serve``: the engine loop on the main thread, uvicorn on a helper thread."""

from __future__ import annotations

import argparse
import logging
import signal
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType

import uvicorn
from fastapi import FastAPI

from engine.async_engine import AsyncEngine
from engine.llm_engine import LLMEngine
from engine.workers import exit_now, run_node, run_torchrun_rank, torchrun_rank
from server.app import CORSSettings, build_app
from server.cli.args import engine_config
from server.engine_client import EngineClient

logger = logging.getLogger("kvserve")


class DrainingServer(uvicorn.Server):
    """uvicorn, plus: a signal first flips the app into draining (new requests
    get 503 while in-flight ones finish).

    uvicorn runs on a helper thread, where it installs no signal handlers (and
    so re-raises none after its graceful shutdown, which keeps the exit status
    0): :func:`serve_app` routes SIGINT and SIGTERM to :meth:`handle_exit` from
    the main thread.
    """

    def __init__(self, config: uvicorn.Config, on_drain: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_drain = on_drain

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._on_drain()
        super().handle_exit(sig, frame)


@dataclass(frozen=True)
class TLSSettings:
    """HTTPS as vLLM's ``--ssl-keyfile``, ``--ssl-certfile``, ``--ssl-ca-certs`` and
    ``--ssl-cert-reqs`` set it (uvicorn's own settings): a PEM key and certificate, and
    for client certificates the CAs that sign them and whether one is required
    (``ssl.CERT_NONE`` 0, ``CERT_OPTIONAL`` 1, ``CERT_REQUIRED`` 2)."""

    keyfile: str
    certfile: str
    ca_certs: str | None = None
    cert_reqs: int = ssl.CERT_NONE


# Seconds uvicorn waits past --shutdown-timeout before it cancels what is left:
# by then the drain has aborted every request, and their clients are being told.
ABORT_GRACE_SECONDS = 5.0


def make_server(app: FastAPI, host: str, port: int, shutdown_timeout: float, log_level: str,
                on_drain: Callable[[], None], tls: TLSSettings | None = None) -> DrainingServer:
    """A server whose signal calls ``on_drain`` (which aborts what still runs after
    ``shutdown_timeout``: ``ServerState.begin_drain``); uvicorn itself cancels
    connections only ``ABORT_GRACE_SECONDS`` later, as a backstop. ``tls``: HTTPS."""
    ssl_options = {} if tls is None else {"ssl_keyfile": tls.keyfile, "ssl_certfile": tls.certfile,
                                          "ssl_ca_certs": tls.ca_certs, "ssl_cert_reqs": tls.cert_reqs}
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=shutdown_timeout + ABORT_GRACE_SECONDS, **ssl_options)
    return DrainingServer(config, on_drain)


def serve_app(engine: EngineClient, server: DrainingServer) -> int:
    """Serve until SIGINT/SIGTERM: ``engine.run_loop`` on this (main) thread, where
    torch's thread pool is fast, and ``server`` on a helper thread. Returns the exit status."""
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
        engine.run_loop(give_up=http_done)
        # Signals must still reach uvicorn while it drains: keep waking up.
        while http.is_alive():
            http.join(0.2)
    finally:
        # The drain is over, but the process is not gone yet (interpreter
        # teardown with torch takes a moment, longer on a busy machine): a
        # supervisor's repeated SIGTERM then must not kill it with status -15.
        # SIGINT gets its old handler back, so a second Ctrl-C still stops it.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, previous[signal.SIGINT])
    # uvicorn returns normally after a signal-driven graceful shutdown; a failed
    # start-up (port in use, lifespan error) leaves ``started`` false.
    return 0 if server.started else 1


def cmd_serve(args: argparse.Namespace) -> int:
    """Load the model named in ``args`` and serve it."""
    config = engine_config(args)
    if args.metrics_require_key and not args.api_key:
        raise SystemExit("kvserve: error: --metrics-require-key needs --api-key (or $KVSERVE_API_KEY)")
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise SystemExit("kvserve: error: HTTPS needs both --ssl-keyfile and --ssl-certfile")
    if args.ssl_ca_certs and not args.ssl_certfile:
        raise SystemExit("kvserve: error: --ssl-ca-certs (client certificates) needs --ssl-keyfile and --ssl-certfile")
    if args.replicas is not None or args.max_replicas is not None:
        if args.ssl_keyfile or args.ssl_certfile:
            # Each replica answers Ray Serve's proxy over plain HTTP on this host.
            raise SystemExit("kvserve: error: --ssl-keyfile/--ssl-certfile do not go with --replicas; "
                             "terminate TLS in front of Ray Serve's proxy")
        if args.allow_runtime_lora:
            # A load would reach the one replica that Ray routes it to.
            raise SystemExit("kvserve: error: --allow-runtime-lora does not go with --replicas (an adapter "
                             "would load on one replica only); give every replica --lora-modules")
        return _serve_replicas(args)
    logger.info("loading model %s", config.model)
    par = config.parallel
    if par.node_rank > 0:  # another host's ranks: no HTTP here
        return run_node(config)
    found = torchrun_rank()
    if found is not None and found[0] > 0:  # torchrun started this process as a rank
        return run_torchrun_rank(config, found[0])
    try:
        llm = LLMEngine(config)
    except ValueError as e:  # a bad model name or setting: say it, no traceback
        raise SystemExit(f"kvserve: error: {e}") from None
    try:
        status = _serve(args, AsyncEngine(llm))
    finally:
        llm.shutdown()
    if llm.workers is not None:  # tensor parallel: leave before gloo's teardown can abort
        exit_now(status)
    return status


# Options of `serve` that belong to the Ray application, not to each replica's kvserve.
_APP_OPTIONS = {"--replicas", "--max-replicas", "--target-ongoing-requests", "--upscale-delay",
                "--downscale-delay", "--host", "--port"}


def replica_argv(argv: list[str]) -> list[str]:
    """``serve``'s own arguments minus the application's (``_APP_OPTIONS``): what each replica runs."""
    out: list[str] = []
    args = iter(argv[argv.index("serve") + 1:] if "serve" in argv else argv)
    for arg in args:
        name = arg.split("=", 1)[0]
        if name in _APP_OPTIONS:
            if "=" not in arg:
                next(args, None)
            continue
        out.append(arg)
    return out


def _serve_replicas(args: argparse.Namespace) -> int:
    try:
        from server import ray_app  # noqa: PLC0415 - an optional extra
    except ImportError as e:
        raise SystemExit(f"kvserve: error: --replicas needs Ray Serve: pip install 'kvserve[ray]' ({e})") from None
    try:
        app = ray_app.deployment(replica_argv(args.argv), args.replicas or 1, args.max_replicas,
                                 args.target_ongoing_requests, upscale_delay_s=args.upscale_delay,
                                 downscale_delay_s=args.downscale_delay)
    except ValueError as e:
        raise SystemExit(f"kvserve: error: {e}") from None
    return ray_app.run(app, args.host, args.port)


def _serve(args: argparse.Namespace, engine: AsyncEngine) -> int:
    app = build_app(engine, api_key=args.api_key, max_queue=args.max_queue,
                    max_body_size=args.max_body_size, served_model_name=args.served_model_name,
                    metrics_require_key=args.metrics_require_key, tool_call_parser=args.tool_call_parser,
                    max_stored_responses=args.max_stored_responses, reasoning_parser=args.reasoning_parser,
                    runtime_lora=args.allow_runtime_lora, log_requests=args.enable_log_requests,
                    max_log_len=args.max_log_len,
                    cors=CORSSettings(tuple(args.allowed_origins), args.allow_credentials,
                                      tuple(args.allowed_methods), tuple(args.allowed_headers)))
    state = app.state.kvserve
    tls = TLSSettings(args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs, args.ssl_cert_reqs) \
        if args.ssl_keyfile or args.ssl_certfile else None
    logger.info("kvserve listening on %s://%s:%d (model %s, max_model_len %d, auth %s)",
                "https" if tls else "http", args.host, args.port, state.model_name, engine.max_model_len,
                "on" if args.api_key else "off")
    logger.info("tool calls: %s (%s)", state.tool_format.describe(),
                "the chat template renders tools" if state.tool_format.native
                else "tools listed in the system message")
    if state.reasoning is not None:
        logger.info("reasoning: %s parser (the reasoning goes to reasoning_content)", state.reasoning.name)
    logger.info("KV cache: %d blocks x %d tokens = %d tokens", engine.num_kv_blocks,
                engine.block_size, engine.num_kv_blocks * engine.block_size)

    def drain() -> None:
        state.begin_drain(args.shutdown_timeout)

    server = make_server(app, args.host, args.port, args.shutdown_timeout, args.log_level, drain, tls)
    return serve_app(engine, server)

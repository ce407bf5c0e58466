"""``kvserve run-batch``: the engine loop on the main thread (as ``serve`` runs it),
the batch's requests on a helper thread's event loop (``server.batch``)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from typing import TextIO

import httpx

from engine.async_engine import AsyncEngine
from engine.llm_engine import LLMEngine
from engine.workers import exit_now
from server.app import build_app
from server.batch import BatchRequest, BatchSummary, parse_batch, run_batch
from server.cli.args import engine_config

logger = logging.getLogger("kvserve")


def _is_url(path: str) -> bool:
    return path.startswith(("http://", "https://"))


def _read_lines(path: str) -> list[str]:
    """The input file's lines: a path, ``-`` (stdin) or an http(s) URL (one GET, as vLLM's)."""
    if path == "-":
        return sys.stdin.read().splitlines()
    if _is_url(path):
        try:
            r = httpx.get(path, follow_redirects=True, timeout=300.0)
            r.raise_for_status()
            return r.text.splitlines()
        except httpx.HTTPError as e:
            raise SystemExit(f"kvserve: error: cannot read --input-file: {e}") from None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise SystemExit(f"kvserve: error: cannot read --input-file: {e}") from None


def _open_output(path: str, stack: ExitStack) -> TextIO:
    """Where the answers are written as they come: a file, stdout (``-``), or for an
    http(s) URL a temporary file that ``_upload`` sends when the batch is done."""
    if path == "-":
        return sys.stdout
    if _is_url(path):
        return stack.enter_context(tempfile.TemporaryFile("w+", encoding="utf-8"))
    try:
        return stack.enter_context(open(path, "w", encoding="utf-8"))
    except OSError as e:
        raise SystemExit(f"kvserve: error: cannot write --output-file: {e}") from None


def _upload(path: str, out: TextIO) -> None:
    """For an http(s) URL output: the whole answer file in one PUT (as vLLM's run-batch)."""
    if not _is_url(path):
        return
    out.flush()
    out.seek(0)
    try:
        r = httpx.put(path, content=out.read().encode("utf-8"), timeout=300.0)
        r.raise_for_status()
    except httpx.HTTPError as e:
        raise SystemExit(f"kvserve: error: cannot write --output-file: {e}") from None


def cmd_run_batch(args: argparse.Namespace) -> int:
    """Answer ``args.input_file``'s requests into ``args.output_file``. Exits 0 when
    every line has its answer (some may be errors: the summary line counts them)."""
    # The whole file is checked, and the output opened, before the model loads.
    try:
        requests = parse_batch(_read_lines(args.input_file))
    except ValueError as e:
        raise SystemExit(f"kvserve: error: --input-file {e}") from None
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise SystemExit("kvserve: error: --max-concurrency must be at least 1")
    config = engine_config(args)
    with ExitStack() as stack:
        out = _open_output(args.output_file, stack)
        if not requests:
            logger.info("run-batch: %s holds no requests", args.input_file)
            _upload(args.output_file, out)
            return 0
        try:
            llm = LLMEngine(config)
        except ValueError as e:
            raise SystemExit(f"kvserve: error: {e}") from None
        try:
            status = _run(args, llm, requests, out)
        finally:
            llm.shutdown()
        _upload(args.output_file, out)
    if llm.workers is not None:  # tensor parallel: leave before gloo's teardown can abort (as serve)
        exit_now(status)
    return status


def _run(args: argparse.Namespace, llm: LLMEngine, requests: list[BatchRequest], out: TextIO) -> int:
    engine = AsyncEngine(llm)
    # httpx logs every request at INFO: a batch's requests are counted by the progress bar.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    app = build_app(engine, served_model_name=args.served_model_name, tool_call_parser=args.tool_call_parser,
                    reasoning_parser=args.reasoning_parser, max_stored_responses=0,
                    log_requests=args.enable_log_requests, max_log_len=args.max_log_len, cors=None,
                    max_body_size=sys.maxsize)  # a line's body was read already
    concurrency = args.max_concurrency or 2 * llm.budget.max_num_seqs
    result: list[BatchSummary] = []
    failure: list[BaseException] = []
    done = threading.Event()

    def answer() -> None:
        try:
            result.append(asyncio.run(run_batch(app, requests, out, concurrency=concurrency,
                                                progress=not args.no_progress)))
        except BaseException as e:  # noqa: BLE001 - reported on the main thread
            failure.append(e)
        finally:
            done.set()

    logger.info("run-batch: %d requests from %s, up to %d at once", len(requests), args.input_file, concurrency)
    start = time.perf_counter()
    # A daemon: Ctrl-C on the main thread ends the process without waiting for it.
    client = threading.Thread(target=answer, name="kvserve-batch", daemon=True)
    client.start()
    engine.run_loop(give_up=done)  # returns when the app's lifespan shuts the engine down
    client.join()
    if failure:
        raise SystemExit(f"kvserve: error: run-batch stopped: {failure[0]!r}")
    [summary] = result
    logger.info("run-batch: %d answered (%d succeeded, %d failed) in %.1f s, written to %s",
                summary.succeeded + summary.failed, summary.succeeded, summary.failed,
                time.perf_counter() - start, args.output_file)
    return 0

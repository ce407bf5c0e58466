"""The ``kvserve`` command, the program's front door: ``serve``, ``run-batch``
and ``generate`` (offline), ``chat``, ``bench`` and ``fetch`` (a known model).

It sits above the HTTP layer: ``serve`` wires the engine to ``server.app``,
``chat`` is a client of a running server and ``bench`` runs ``bench/``'s load
generator. Each subcommand's module is imported when it runs, so ``kvserve
chat`` starts without loading torch.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from engine.sampling_params import SamplingParams
from server.cli.args import GENERATE_ADAPTER, build_parser, engine_config


def _cmd_serve(args: argparse.Namespace) -> int:
    from server.cli.serve import cmd_serve

    return cmd_serve(args)


def _cmd_run_batch(args: argparse.Namespace) -> int:
    from server.cli.run_batch import cmd_run_batch

    return cmd_run_batch(args)


def _cmd_generate(args: argparse.Namespace) -> int:
    """Offline generation for one prompt through the synchronous ``LLMEngine``."""
    from engine.llm_engine import LLMEngine  # loads torch

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
        llm = LLMEngine(engine_config(args))
    except ValueError as e:
        raise SystemExit(f"kvserve: error: {e}") from None
    # One list of n samples per prompt.
    [samples] = llm.generate([args.prompt], params, use_tqdm=False,
                             adapter=GENERATE_ADAPTER if args.lora else None)
    for sample in samples:
        print(sample.text)
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    from server.cli.chat import ChatSession, run

    session = ChatSession(args.url, api_key=args.api_key, system=args.system, model=args.model,
                          temperature=args.temperature)
    return run(session)


def _cmd_fetch(args: argparse.Namespace) -> int:
    """Download a known model into the cache (``engine.fetch``) and print its path."""
    from engine.fetch import fetch_model

    try:
        print(fetch_model(args.name, force=args.force))
    except ValueError as e:
        raise SystemExit(f"kvserve: error: {e}") from None
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    # bench/ is a client of any OpenAI-compatible server; only this subcommand needs it.
    import bench.serve

    assert args.tool == "serve", args.tool  # the parser's only choice
    return bench.serve.main(args.args, prog="kvserve bench serve")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvserve`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # --replicas passes the other options on to each replica
    # The chat client's screen is the conversation: only warnings go to the log.
    level = "warning" if args.command == "chat" else getattr(args, "log_level", "info")
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    commands = {"serve": _cmd_serve, "run-batch": _cmd_run_batch, "generate": _cmd_generate, "chat": _cmd_chat,
                "bench": _cmd_bench, "fetch": _cmd_fetch}
    return commands[args.command](args)

"""``python -m models.ops``: build the fused CPU kernels ahead of the first run and say
what they can use; with ``--choose-path MODEL``, also make the ``auto`` path choice.

It lives beside ``models.ops`` rather than in it because the path choice needs
``models.autotune`` and ``models.loader``, which themselves run on ``models.ops``.
"""

from __future__ import annotations

import argparse
import logging

from models import autotune, loader, ops


def main(argv: list[str] | None = None) -> int:
    """``python -m models.ops``: build the kernels ahead of the first run; with
    ``--choose-path MODEL``, also make (and log) the ``auto`` path choice for MODEL."""
    p = argparse.ArgumentParser(prog="python -m models.ops", description=main.__doc__)
    p.add_argument("--choose-path", metavar="MODEL", default=None,
                   help="a model name, directory or .gguf file (e.g. smollm2)")
    p.add_argument("--measure-again", action="store_true",
                   help="with --choose-path: measure even if the kernel cache holds a choice, and replace it")
    args = p.parse_args(argv)
    if args.measure_again and not args.choose_path:
        p.error("--measure-again goes with --choose-path MODEL")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if ops.kernels_available():
        amx = ("usable, forced for w4a8 (KVSERVE_AMX=force)" if ops.amx_usable() and ops.amx_mode() == "force"
               else "usable, offered to the path choice" if ops.amx_usable()
               else "present, not offered (KVSERVE_AMX=0 or the self-check; see above)" if ops.amx_hardware()
               else "not on this CPU")
        bf16 = ("usable (w4a16 offered to the path choice; amx-bf16 when asked for)" if ops.amx_bf16_usable()
                else "not usable")
        print(f"fused CPU kernels: ready ({ops.vector_isa()}; int8 dots: {ops.int8_dots() or 'none'}; "
              f"AMX-INT8: {amx}; AMX-BF16: {bf16})")
    else:
        print("fused CPU kernels: unavailable, plain torch ops will run")
    if args.choose_path:
        config, gguf_type, types = loader.read_config(args.choose_path)
        path = autotune.choose(config, "auto", "auto", four_bit=autotune.four_bit(gguf_type),
                               measure_again=args.measure_again, types=types)
        print(f"path auto for {args.choose_path}: {path}")
    return 0

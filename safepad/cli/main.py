"""``safepad`` command line entry point (console script and ``python -m safepad``)."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Sequence

from torch import nn

from . import audit as audit_cmd

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="safepad",
        description="Padding- and packing-correct Mamba-family and hybrid SSMs in HuggingFace transformers.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    audit_cmd.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None, *, wrap_fn: Callable[[nn.Module], nn.Module] | None = None) -> int:
    """Run the CLI; return the exit status (0 success, 1 a check failed, 2 usage error).

    Args:
        argv: arguments without the program name (default ``sys.argv[1:]``).
        wrap_fn: ``audit`` only: wrap with this instead of ``safepad.wrap.wrap`` (tests, custom wrappers).
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on usage errors and 0 on --help
        return int(exc.code) if isinstance(exc.code, int) else 2
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.run(args, parser, wrap_fn=wrap_fn)
    except SystemExit as exc:  # parser.error() inside a command
        return int(exc.code) if isinstance(exc.code, int) else 2

"""The schedcomp command line: `main(argv) -> exit status`, a thin shell over the library.

Each subcommand lives in its own module exposing `register(subparsers)`, which adds its
parser and sets `run=function(args) -> int`. To add one, append its module to `COMMANDS`.

Every `SchedcompError`, bad argument or unreadable file becomes exactly one line on stderr,
`schedcomp: error: ...`, and exit status 2. Only this package prints.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from schedcomp.cli import compare, compile, goodput, precompile, profile, repair, show, simulate, torch_csv
from schedcomp.cli.common import ArgumentError, Parser, one_line
from schedcomp.errors import SchedcompError

COMMANDS = [show, simulate, torch_csv, profile, compile, repair, precompile, compare, goodput]
"""Subcommand modules, in the order `schedcomp --help` lists them."""


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="schedcomp", description="Compile, check, simulate and draw pipeline-parallel schedules.")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log progress (-vv: debug)")
    from schedcomp import __version__

    parser.add_argument("--version", action="version", version=f"schedcomp {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMANDS:
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status (0 ok, 2 bad input)."""
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # named with the subcommand whose arguments they are not
            raise ArgumentError(f"{args.command}: unrecognized arguments: {' '.join(extra)} "
                                f"(see schedcomp {args.command} --help)")
    except ArgumentError as exc:
        return _fail(str(exc))
    except SystemExit as exc:  # --help, --version
        return exc.code if isinstance(exc.code, int) else 0
    logging.basicConfig(level=[logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)],
                        format="schedcomp: %(message)s", stream=sys.stderr)
    try:
        return int(args.run(args) or 0)
    except (SchedcompError, ArgumentError) as exc:
        return _fail(str(exc))
    except BrokenPipeError:  # `schedcomp show ... | head`
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except OSError as exc:
        name = f" {exc.filename}" if exc.filename else ""
        return _fail(f"cannot access{name}: {exc.strerror or exc}")
    except KeyboardInterrupt:
        return 130


def _fail(message: str) -> int:
    print(f"schedcomp: error: {one_line(message)}", file=sys.stderr)
    return 2


__all__ = ["COMMANDS", "build_parser", "main"]

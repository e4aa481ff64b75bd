"""`distserve`: one command, a subcommand per job."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# each subcommand's module (distserve.commands.<name>), in the order --help lists them; a
# command line imports only its own: `bench`, `generate` and `profile` load torch, which took
# 4 of the 5 s `distserve plan` spent starting
COMMANDS = ("generate", "up", "profile", "plan", "simulate", "bench", "replay")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand, or of `command` alone where it names one."""
    parser = argparse.ArgumentParser(
        prog="distserve",
        description="Disaggregated prefill/decode LLM serving (DistServe, OSDI'24).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in (command,) if command in COMMANDS else COMMANDS:
        importlib.import_module(f"distserve.commands.{name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv[0] if argv else None)
    args = parser.parse_args(argv)
    result: int = args.run(args, args.parser)
    return result


if __name__ == "__main__":
    sys.exit(main())

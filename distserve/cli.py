"""`distserve`: one command, a subcommand per job."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from distserve.commands import bench, generate, plan, profile, replay, simulate, up


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="distserve",
        description="Disaggregated prefill/decode LLM serving (DistServe, OSDI'24).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    generate.register(sub)
    up.register(sub)
    profile.register(sub)
    plan.register(sub)
    simulate.register(sub)
    bench.register(sub)
    replay.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    result: int = args.run(args, args.parser)
    return result


if __name__ == "__main__":
    sys.exit(main())

"""Subcommands of `distserve`; each module has `register(subparsers)` and a `run`."""

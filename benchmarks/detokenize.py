"""Detokenizing a generation token by token, as the engine streams it: the incremental
detokenizer (a window of the last ids a token) against decoding the whole list each token
(what it did before), over HumanEval's prompts and solutions as one long output:

    .venv/bin/python benchmarks/detokenize.py [--lengths 256 1024 4096]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from distserve.bench.workload import humaneval_prompts
from shared.engine.meta import read_tokenizer
from shared.engine.tokenizer import IncrementalDetokenizer, TextTokenizer


class WholeList:
    """Each update decodes every id so far."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer, self.text = tokenizer, ""

    def update(self, ids: Sequence[int]) -> str:
        text = self.tokenizer.decode(ids)
        if text.endswith("\ufffd"):
            return ""
        delta, self.text = text[len(self.text):], text
        return delta


def us_a_token(detok: WholeList | IncrementalDetokenizer, ids: list[int], last: int) -> float:
    """Microseconds a token over the generation's last `last` tokens (the list grows by one
    id a token, as a request's output does)."""
    grown: list[int] = []
    for token in ids[:-last]:
        grown.append(token)
        detok.update(grown)
    start = time.perf_counter()
    for token in ids[-last:]:
        grown.append(token)
        detok.update(grown)
    return (time.perf_counter() - start) / last * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    args = parser.parse_args()
    tokenizer = read_tokenizer(args.model)
    assert tokenizer is not None
    ids = tokenizer.encode("".join(p + s for p, s in humaneval_prompts()))
    table = Table(title="detokenizing a generation: us a token, over its last 64 tokens")
    for column in ("tokens", "whole list", "window", "speed-up"):
        table.add_column(column, justify="right")
    for n in args.lengths:
        whole = us_a_token(WholeList(tokenizer), ids[:n], 64)
        window = us_a_token(IncrementalDetokenizer(tokenizer), ids[:n], 64)
        table.add_row(str(n), f"{whole:.1f}", f"{window:.1f}", f"{whole / window:.1f}x")
    Console().print(table)


if __name__ == "__main__":
    main()

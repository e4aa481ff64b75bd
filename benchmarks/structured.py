"""What holding answers to a JSON schema costs a decode step: the same batch of requests run
with and without a grammar, interleaved in one engine, side by side (ms a step, and the
grammar's own share: `constrain`, the matchers fed, their masks computed and applied).

    .venv/bin/python benchmarks/structured.py [--batch 1 8 32] [--tokens 48] [--threads 2]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from shared.engine import model_runner, structured
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.engine.request import SamplingParams

# a story too long to finish in the tokens run: every token is drawn inside the grammar (a
# finished one allows only the end of sequence, which ignore_eos would repeat at no cost)
SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "city", "hobbies", "story"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "city": {"type": "string"},
                         "hobbies": {"type": "array", "items": {"type": "string"},
                                     "maxItems": 3},
                         "story": {"type": "string", "minLength": 4000}}}


class MaskClock:
    """Time the steps spend in `constrain`, and its calls."""

    def __init__(self) -> None:
        self.seconds, self.calls = 0.0, 0
        self.inner = model_runner.constrain

    def __enter__(self) -> MaskClock:
        clock = self

        def constrain(*args: Any) -> torch.Tensor:
            start = time.perf_counter()
            try:
                return clock.inner(*args)
            finally:
                clock.seconds += time.perf_counter() - start
                clock.calls += 1
        model_runner.constrain = constrain  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        model_runner.constrain = self.inner


def decode_ms(engine: Engine, prompt: list[int], batch: int, params: SamplingParams
              ) -> tuple[float, int]:
    """Mean ms of the steps after the batch's prefill, and how many steps."""
    for i in range(batch):
        engine.add_request(f"r{i}", prompt, params)
    engine.step()  # the prefill
    steps, start = 0, time.perf_counter()
    while engine.has_work():
        engine.step()
        steps += 1
    return (time.perf_counter() - start) * 1e3 / max(1, steps), steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    engine = Engine(EngineConfig(threads=args.threads))
    assert engine.tokenizer is not None
    prompt = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Describe a person as JSON."}]))
    grammar = structured.json_grammar(SCHEMA)
    # ignore_eos: every request runs all its tokens, so both runs step the same batch
    free = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    held = SamplingParams(max_tokens=args.tokens, ignore_eos=True, grammar=grammar)
    decode_ms(engine, prompt, 1, held)  # warm-up: the tokenizer llguidance reads, built once
    table = Table(title=f"decode step, {args.tokens} tokens a request, {args.threads} threads")
    for column in ("batch", "free ms/step", "schema ms/step", "ratio", "masks ms/step"):
        table.add_column(column, justify="right")
    for batch in args.batch:
        free_ms, held_ms, mask_ms = [], [], []
        for _ in range(args.repeats):  # interleaved: a slow spell of the host hits both
            free_ms.append(decode_ms(engine, prompt, batch, free)[0])
            with MaskClock() as clock:
                held_ms.append(decode_ms(engine, prompt, batch, held)[0])
            mask_ms.append(clock.seconds * 1e3 / max(1, clock.calls))
        f, h, m = min(free_ms), min(held_ms), min(mask_ms)
        table.add_row(str(batch), f"{f:.1f}", f"{h:.1f}", f"{h / f:.2f}x", f"{m:.2f}")
    Console().print(table)


if __name__ == "__main__":
    main()

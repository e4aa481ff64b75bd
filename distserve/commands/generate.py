"""`distserve generate PROMPT`: run one prompt through the engine and print the completion."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from distserve.commands.common import add_engine_args, engine_config
from shared.engine.engine import Engine, RequestRejected
from shared.engine.gguf_loader import ModelNotFoundError
from shared.engine.request import SamplingParams
from shared.engine.tokenizer import ChatTemplateError


def register(sub: Any) -> None:
    p = sub.add_parser("generate", help="generate a completion for one prompt",
                       description="Generate a completion for PROMPT with the in-process engine.")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt in the model's chat template as a user message")
    p.add_argument("--max-tokens", type=int, default=64,
                   help="most tokens to generate (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 is greedy (default: %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling draws")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_engine_args(p)
    p.set_defaults(parser=p, run=run)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if not args.prompt.strip():
        parser.error("the prompt is empty")
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                stop=tuple(args.stop))
    except ValueError as e:
        parser.error(str(e))
    try:
        engine = Engine(engine_config(args))
    except (ModelNotFoundError, ValueError) as e:
        parser.error(str(e))
    try:
        return _generate(engine, args, params, parser)
    finally:
        engine.close()


def _generate(engine: Engine, args: argparse.Namespace, params: SamplingParams,
              parser: argparse.ArgumentParser) -> int:
    tokenizer = engine.tokenizer
    if tokenizer is None:
        parser.error(f"model {args.model!r} has random weights and no tokenizer")
    if args.chat:
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
        except ChatTemplateError as e:
            parser.error(str(e))
        ids = tokenizer.encode(text)
    else:
        ids = tokenizer.encode(args.prompt, add_special_tokens=True)
    try:
        engine.add_request("cli", ids, params)
    except RequestRejected as e:
        parser.error(str(e))
    while engine.has_work():
        for output in engine.step():
            sys.stdout.write(output.new_text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0

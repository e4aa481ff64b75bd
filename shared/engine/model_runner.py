"""The only code that touches the device: loads the model, owns the KV pool, turns a
SchedulerOutput into tensors, runs the forward pass and samples."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from shared.engine import loader, meta
from shared.engine.attention import (
    AttentionMetadata,
    DecodeGroup,
    PrefillSegment,
    pick_decode_attention,
)
from shared.engine.config import EngineConfig, ModelConfig, weight_bits
from shared.engine.kv_cache import Alloc, KVCache
from shared.engine.loader import LoadedModel
from shared.engine.model import LlamaModel
from shared.engine.parallel.group import Command, RankFailed, Ranks, rank_threads
from shared.engine.parallel.kv_serving import export_part
from shared.engine.parallel.layout import (
    KvSpan,
    RankPlace,
    check_tp,
    kv_block_bytes,
    kv_budget_problem,
    stage_layers,
)
from shared.engine.parallel.packet import pack
from shared.engine.parallel.pipeline import hidden_states, last_stage, run_stage
from shared.engine.request import Draw, TopLogprobs
from shared.engine.sampler import adjust, constrain, likeliest, sample, top_logprobs
from shared.engine.scheduler import ScheduledChunk, SchedulerOutput
from shared.host import NATIVE_16BIT, computes_natively, cpu_flags

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as `--dtype` names it ("bfloat16")."""
    return str(dtype).removeprefix("torch.")

SCORED_ROWS = 256  # prompt rows whose logits are held at once (each a vocabulary wide)


def resolve_device(name: str) -> torch.device:
    """The device `name` (cpu, cuda, cuda:N or auto) names here; a ValueError saying why
    where it names none."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {name!r}: choose cpu, cuda, cuda:N or auto")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: no CUDA device is visible to this torch")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device {name!r}: this machine has {torch.cuda.device_count()} "
                         f"CUDA devices")
    return device


def bf16_native(device: torch.device) -> bool:
    """Whether the GPU computes in bfloat16 itself (Ampere on), not by emulation."""
    return torch.cuda.get_device_capability(device) >= (8, 0)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if bf16_native(device) else torch.float16
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: choose one of {sorted(DTYPES)}")
    if DTYPES[name] is torch.bfloat16 and device.type == "cuda" and not bf16_native(device):
        raise ValueError(f"{device} cannot compute in bfloat16: use --dtype float16 or float32")
    if device.type == "cpu" and not computes_natively(name, cpu_flags()):
        log.warning("this CPU has no %s dot products (%s): torch converts every matmul to "
                    "float32 as it goes, so %s may be slower here than float32; time it "
                    "first (benchmarks/prefill_dtype.py)", name,
                    " or ".join(sorted(NATIVE_16BIT[name])), name)
    elif device.type == "cpu" and name in NATIVE_16BIT:
        ms, ms_float32 = prefill_matmul_ms(name, torch.get_num_threads())
        if ms >= ms_float32:
            log.warning("%s matmuls run slower than float32's on this CPU although it has %s "
                        "dot products (a 256-token prompt's matmul: %.1f ms, float32 %.1f): "
                        "float32 is the faster prefill here (benchmarks/prefill_dtype.py "
                        "times the model)", name, name, ms, ms_float32)
    return DTYPES[name]


@functools.cache
def prefill_matmul_ms(name: str, threads: int, rows: int = 256) -> tuple[float, float]:
    """The fastest of a few runs of one prefill-shaped matmul (SmolLM2's MLP: `rows` x 576
    by 576 x 1536) in `name` and in float32, interleaved, ms: whether the CPU's 16-bit dot
    products pay is measured, not read off its flags (a Xeon with AVX512_BF16 but no AMX
    ran bfloat16 GEMMs 1.4-1.7x slower than float32's, a Zen 5 with the same flag 1.3x
    faster). Tens of ms, once a process and dtype."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 576, generator=generator)
    w = torch.randn(1536, 576, generator=generator)
    pairs = {torch.float32: (x, w), DTYPES[name]: (x.to(DTYPES[name]), w.to(DTYPES[name]))}
    best = dict.fromkeys(pairs, math.inf)
    for _ in range(4):
        for dtype, (a, b) in pairs.items():
            start = time.perf_counter()
            torch.nn.functional.linear(a, b)
            best[dtype] = min(best[dtype], (time.perf_counter() - start) * 1e3)
    return best[DTYPES[name]], best[torch.float32]


def kv_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The KV pool's dtype: float32 on the CPU whatever the instance computes in, so every
    CPU instance's KV moves to any other unchanged (a bfloat16 prefill instance, whose
    matmuls run twice as wide where the CPU has bfloat16 dot products, hands its KV to a
    float32 or int4 decode instance); on a GPU the model's dtype."""
    return torch.float32 if device.type == "cpu" else dtype


def load_model(config: EngineConfig, rank: int = 0) -> LoadedModel:
    """The model named in `config` (a Hugging Face directory, a GGUF, or a Llama shape with
    random weights) on its device, in its dtype, with its tokenizer: rank `rank`'s part of
    it where the config has several ranks (tp, pp)."""
    device = resolve_device(config.device)
    return loader.load(config.model, config.seed, device, resolve_dtype(config.dtype, device),
                       config.weights, RankPlace(rank, config.tp, config.pp))


def check_parallel(config: EngineConfig) -> None:
    """ValueError, before any rank starts, where the config's ranks cannot run its model."""
    kind = resolve_device("auto").type if config.device == "auto" else \
        config.device.split(":")[0]  # as named: a GPU this machine lacks is refused so too
    if kind != "cpu":
        raise ValueError("instances of several ranks (--tp, --pp) run on the CPU (gloo) in "
                         "this build; on GPUs (NCCL) they are not built yet")
    model = meta.read_config(config.model)
    check_tp(model, config.tp, quantized=weight_bits(config.weights) is not None)
    stage_layers(model.num_layers, config.pp)


def kv_pool(model: LlamaModel, config: EngineConfig) -> KVCache:
    """The model's KV pool from the config's budget: the same number of blocks on every rank
    of an instance (sized for its largest stage), so rank 0's block ids hold everywhere."""
    dtype, block_size = kv_dtype(model.device, model.dtype), config.scheduler.block_size
    block = kv_block_bytes(model.config, config.tp, config.pp, block_size, dtype.itemsize)
    problem = kv_budget_problem(config.kv_cache_bytes, block, block_size, model.config.name)
    if problem is not None:
        raise ValueError(problem)
    return KVCache(model.shard, config.kv_cache_bytes // block, block_size, dtype, model.device)


@dataclass
class Launched:
    """A step under way: its chunks and the whole model's hidden states over their tokens,
    there once `arriving` (a pipeline's receive from its last stage) completes."""

    out: SchedulerOutput
    hidden: torch.Tensor
    arriving: Any = None  # a gloo Work


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        """`loaded` lets several engines (roles, tests, benchmarks) share one model copy.
        With several ranks (`config.tp`, `config.pp`) this is rank 0: it starts the other
        ranks first (they load their parts while it loads its own)."""
        assert loaded is None or config.ranks == 1, "a parallel model is loaded per rank"
        if config.threads > 0 or config.ranks > 1:
            torch.set_num_threads(rank_threads(config))
        self.ranks: Ranks | None = None
        self.depth = config.pp  # steps under way at once: a pipeline's micro-batches
        if config.ranks > 1:
            check_parallel(config)
            self.ranks = Ranks(config)
        try:
            self.model, self.tokenizer = loaded if loaded is not None else load_model(config)
            self.kv = kv_pool(self.model, config)
        except BaseException:
            self.close()
            raise
        self.device, self.dtype = self.model.device, self.model.dtype
        self.model.decode_attention = pick_decode_attention(self.device)
        if self.ranks is not None and config.tp > 1:
            self.model.all_reduce = self.ranks.all_reduce

    @property
    def kv_dtype_name(self) -> str:
        """The KV pool's dtype as a name ("float32"): what a KV handoff's two sides compare."""
        return dtype_name(self.kv.data.dtype)

    def close(self) -> None:
        """Stop the other ranks (nothing to do for one rank)."""
        if self.ranks is not None:
            self.ranks.close()

    @property
    def model_config(self) -> ModelConfig:
        return self.model.config

    def execute(self, out: SchedulerOutput) -> dict[str, Draw]:
        """Run one step; return the sampled token (and logprob) of each request that samples."""
        return self.finish(self.launch(out))

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput) -> Launched:
        """Start a step: on one rank, all of it; on several, rank 0's stage of it, the rest
        running on the other ranks while rank 0 goes on (to the next micro-batch)."""
        ids, positions, meta = self._prepare(out)
        if self.ranks is None:
            return Launched(out, self.model.forward(ids, positions, meta, self.kv))
        with self._instance_failure():
            self.ranks.command(Command.STEP, pack(ids, positions, meta))
            hidden = run_stage(self.model, self.kv, ids, positions, meta, self.ranks.hand_on,
                               self.ranks.receive)
            if self.model.place.pp == 1:
                return Launched(out, hidden)
            final = hidden_states(self.model, ids.numel())
            return Launched(out, final, self.ranks.start_receive(final, last_stage(self.model)))

    @torch.inference_mode()
    def finish(self, launched: Launched) -> dict[str, Draw]:
        """Wait for a launched step's hidden states; sample the requests that sample, and
        score the prompt tokens of those that ask (recorded on the request: a chunk that
        does not sample has no draw to carry them)."""
        if launched.arriving is not None:
            assert self.ranks is not None
            with self._instance_failure():
                self.ranks.wait(launched.arriving)
        rows, sampling = [], []
        row = 0
        for chunk in launched.out.chunks:
            if chunk.request.params.prompt_logprobs and not chunk.request.output_ids:
                # (a prompt computed again later, preempted or moved with its KV, was
                # scored and sent before its first token)
                chunk.request.prompt_scores += self._score_prompt(launched.hidden, row, chunk)
            row += chunk.length
            if chunk.samples:
                rows.append(row - 1)
                sampling.append(chunk)
        if not sampling:
            return {}
        logits = self.model.logits(launched.hidden[torch.tensor(rows, device=self.device)])
        params = [c.request.params for c in sampling]
        outputs = [c.request.output_ids for c in sampling]
        logits = adjust(logits, params, outputs)
        # a grammar's tokens only are drawn; logprobs are the model's, as unguided
        guided = constrain(logits, [c.request.guide for c in sampling], outputs)
        tokens, logprobs = sample(guided, params, [len(ids) for ids in outputs], scored=logits)
        tops = top_logprobs(logits, params)
        return {c.request.request_id: Draw(t, lp, top)
                for c, t, lp, top in zip(sampling, tokens, logprobs, tops, strict=True)}

    def _score_prompt(self, hidden: torch.Tensor, row: int, chunk: ScheduledChunk
                      ) -> list[Draw]:
        """The logprob of each prompt token the chunk's rows predict (row p: token p + 1)
        and the likeliest ones, those not scored before (a prompt computed again after a
        preemption is not scored twice); a few hundred rows of logits at a time."""
        request = chunk.request
        prompt, params = request.prompt_ids, request.params
        first = max(chunk.start, len(request.prompt_scores))
        last = min(chunk.start + chunk.length, len(prompt) - 1)
        scores: list[Draw] = []
        for lo in range(first, last, SCORED_ROWS):
            hi = min(lo + SCORED_ROWS, last)
            logprobs = self.model.logits(
                hidden[row + lo - chunk.start:row + hi - chunk.start]).log_softmax(-1)
            targets = prompt[lo + 1:hi + 1]
            chosen = logprobs.gather(
                1, torch.tensor(targets, device=logprobs.device)[:, None]).squeeze(1).tolist()
            tops: list[TopLogprobs] = likeliest(logprobs, params.top_logprobs) \
                if params.top_logprobs else [()] * (hi - lo)
            scores += map(Draw, targets, chosen, tops)
        return scores

    @contextlib.contextmanager
    def _instance_failure(self) -> Iterator[None]:
        """Any failure in rank 0's part of a step of several ranks is the instance's: the
        other ranks are mid-step (in an all-reduce or a hand-off) and out of step with rank
        0 for good."""
        assert self.ranks is not None
        try:
            yield
        except RankFailed:
            raise
        except Exception as e:
            self.ranks.failed = True
            raise RankFailed(f"rank 0 failed mid-step: {type(e).__name__}: {e}") from e

    def export_kv(self, block_ids: list[int]) -> torch.Tensor:
        """Blocks of every layer and KV head as one buffer ([layers, 2, n, block_size, kv
        heads, head dim]): with several ranks, each sends rank 0 its layers' heads."""
        local = self.kv.export_blocks(block_ids)
        if self.ranks is None:
            return local
        self.ranks.command(Command.EXPORT, torch.tensor(block_ids))
        whole = self.kv_buffer(len(block_ids))
        for place in self.ranks.places:
            part = self._part(whole, place)
            if place.rank == 0:
                part.copy_(local)
            else:
                received = torch.empty_like(part)
                self.ranks.receive(received, place.rank)
                part.copy_(received)
        return whole

    def import_kv(self, block_ids: list[int], buffer: torch.Tensor) -> None:
        """An exported buffer into blocks `block_ids`: with several ranks, each is sent its
        layers' heads."""
        if self.ranks is None:
            self.kv.import_blocks(block_ids, buffer)
            return
        self.ranks.command(Command.IMPORT, torch.tensor(block_ids))
        buffer = buffer.to(self.device, self.kv.data.dtype)
        for place in self.ranks.places[1:]:
            self.ranks.send(self._part(buffer, place).contiguous(), place.rank)
        self.kv.import_blocks(block_ids, self._part(buffer, self.ranks.places[0]))

    @property
    def kv_spans(self) -> list[KvSpan]:
        """The part of the KV each rank holds, rank 0 first."""
        places = self.ranks.places if self.ranks is not None else [RankPlace()]
        return [KvSpan.of(place, self.model_config) for place in places]

    def export_part(self, block_ids: list[int], part: KvSpan | None,
                    alloc: Alloc | None = None, skip: int = 0) -> torch.Tensor | None:
        """`part` (None: all) of rank 0's own KV of the blocks but the first `skip`,
        contiguous (in room `alloc` gives); None where rank 0 does not hold all of `part`
        or no block is left (each other rank serves its own: kv_serving)."""
        return export_part(self.kv, block_ids, self.kv_spans[0], part, alloc, skip)

    def _part(self, buffer: torch.Tensor, place: RankPlace) -> torch.Tensor:
        """The view of an exported buffer that rank `place` holds: its layers, its heads."""
        config = self.model_config
        layers, heads = KvSpan.of(place, config).within(KvSpan.whole(config))
        return buffer[layers, :, :, :, heads]

    def kv_buffer(self, num_blocks: int, alloc: Alloc | None = None) -> torch.Tensor:
        """Room for `num_blocks` blocks as `export_kv` lays them out (every rank's heads),
        `alloc`'s where given."""
        config, pool = self.model_config, self.kv.data
        shape = (config.num_layers, 2, num_blocks, self.kv.block_size, config.num_kv_heads,
                 config.head_dim)
        return pool.new_empty(shape) if alloc is None else alloc(shape, pool.dtype)

    def _prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor,
                                                      AttentionMetadata]:
        bs = self.kv.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for chunk in out.chunks:
            request = chunk.request
            span = range(chunk.start, chunk.start + chunk.length)
            ids.extend(request.token_span(chunk.start, chunk.start + chunk.length))
            positions.extend(span)
            slots.extend(request.block_table[p // bs] * bs + p % bs for p in span)
        meta = AttentionMetadata(
            slots=self._tensor(slots),
            prefills=self._prefill_segments(out.prefills),
            decode=self._decode_group(out.decodes, len(ids) - len(out.decodes)),
        )
        return self._tensor(ids), self._tensor(positions), meta

    def _prefill_segments(self, chunks: list[ScheduledChunk]) -> list[PrefillSegment]:
        segments, start = [], 0
        for chunk in chunks:
            table = self._tensor(chunk.request.block_table) if chunk.start else self._empty
            segments.append(PrefillSegment(start, chunk.length, chunk.start, table))
            start += chunk.length
        return segments

    def _decode_group(self, chunks: list[ScheduledChunk], start: int) -> DecodeGroup | None:
        if not chunks:
            return None
        width = max(len(c.request.block_table) for c in chunks)
        tables = [c.request.block_table + [0] * (width - len(c.request.block_table))
                  for c in chunks]
        lengths = self._tensor([c.start + 1 for c in chunks])
        return DecodeGroup.of(start, self._tensor(tables), lengths, self.kv.block_size)

    def _tensor(self, values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    @property
    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.long, device=self.device)

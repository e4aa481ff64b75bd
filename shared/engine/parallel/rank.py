"""A rank other than 0 of a parallel instance: its part of the model (its stage's layers, its
share of their heads) and of the KV pool (the same block ids as every rank's), running each
step rank 0 sends it. Started by `Ranks` as `python -m shared.engine.parallel.rank`; not a
command for people."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import torch
from torch._C._distributed_c10d import Store, TCPStore

from shared.engine.attention import pick_decode_attention
from shared.engine.config import EngineConfig
from shared.engine.model_runner import kv_pool, load_model
from shared.engine.parallel.group import (
    CONFIG,
    Collective,
    Command,
    Outbox,
    collective_timeout,
    connect,
    connect_acks,
    connect_commands,
    connect_stage,
    die_with_parent,
    joined_key,
    payload_text,
    rank_threads,
    receive,
)
from shared.engine.parallel.kv_serving import ORDERS, RankKv, address_key
from shared.engine.parallel.layout import KvSpan, RankPlace
from shared.engine.parallel.packet import unpack
from shared.engine.parallel.pipeline import run_stage

log = logging.getLogger(__name__)


class RankWorker:
    def __init__(self, config: EngineConfig, collective: Collective, stage: Collective,
                 commands: Collective, acks: Collective, store: Store) -> None:
        self.collective, self.commands = collective, commands
        # its stage's outputs, handed on without waiting: the last one's, once the next is
        # computed (the next stage has taken it, or will as soon as it gets to that step)
        self.outbox = Outbox(collective, 1)
        self.model, _ = load_model(config, collective.rank)
        self.model.decode_attention = pick_decode_attention(self.model.device)
        if config.tp > 1:
            self.model.all_reduce = stage.all_reduce
        self.kv = kv_pool(self.model, config)
        self.transfers = RankKv(self.kv, KvSpan.of(self.model.place, self.model.config),
                                store, acks)
        self.rank = collective.rank

    @torch.inference_mode()
    def serve(self) -> None:
        """Run rank 0's commands, in order, until it says stop. A step's output goes on to
        the next stage (or rank 0) without waiting for it to be taken: the next step's
        command may already wait (a pipeline's micro-batches)."""
        while True:
            command, payload = receive(self.commands)
            if command is Command.STOP:
                self.outbox.settle()
                return
            if command is Command.STEP:
                ids, positions, meta = unpack(payload, self.kv.block_size, self.model.device)
                run_stage(self.model, self.kv, ids, positions, meta, self.outbox.send,
                          self.collective.receive)
            elif command is Command.EXPORT:
                self.collective.send(self.kv.export_blocks(payload.tolist()), 0)
            elif command is Command.IMPORT:
                buffer = self.kv.empty_blocks(payload.numel())
                self.collective.receive(buffer, 0)
                self.kv.import_blocks(payload.tolist(), buffer)
            elif command is Command.PARKED:
                parked = json.loads(payload_text(payload))
                self.transfers.parked.update(parked["unpark"], parked["park"])
            elif command is Command.PULL_KV:
                self.transfers.pull(ORDERS.validate_json(payload_text(payload)))
            elif command is Command.SERVE_KV:
                self._serve_kv(json.loads(payload_text(payload)))

    def _serve_kv(self, how: dict[str, str]) -> None:
        """Start the KV listener and tell rank 0 its address (or why it did not start)."""
        try:
            address = self.transfers.serve(how["host"], bytes.fromhex(how["key"]))
        except Exception as e:  # rank 0 reports it and fails the instance
            log.exception("the KV listener did not start")
            address = f"error: {type(e).__name__}: {e}"
        self.transfers.store.set(address_key(self.rank), address)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--config", required=True, help="the instance's EngineConfig as JSON")
    args = parser.parse_args()
    die_with_parent(args.parent)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s rank {args.rank} %(levelname)s %(message)s")
    config = CONFIG.validate_json(args.config)
    torch.set_num_threads(rank_threads(config))
    store = TCPStore("127.0.0.1", args.port, config.ranks, is_master=False,
                     timeout=collective_timeout())
    store.set(joined_key(args.rank), "1")
    collective = connect(store, args.rank, config.ranks)
    stage = connect_stage(store, collective, RankPlace(args.rank, config.tp, config.pp))
    commands = connect_commands(store, args.rank, config.ranks)
    acks = connect_acks(store, args.rank, config.ranks)
    try:
        worker = RankWorker(config, collective, stage, commands, acks, store)
    except ValueError as e:  # rank 0 meets the same reason and reports it
        log.error("cannot load its share of %s: %s", config.model, e)
        sys.exit(2)
    code = 0
    try:
        worker.serve()
    except Exception:  # rank 0 sees the exit (and the failed collective)
        log.exception("rank %d failed", args.rank)
        code = 1
    # UCX's notifier thread, if it did not stop, would keep the process alive
    stopped = worker.transfers.stop()
    logging.shutdown()
    if not stopped:
        os._exit(code or 1)
    sys.exit(code)


if __name__ == "__main__":
    main()

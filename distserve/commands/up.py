"""`distserve up`: the whole stack on this host, until Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import signal
import threading
from pathlib import Path
from typing import Any

from services.launcher import Stack, StackConfig


def register(sub: Any) -> None:
    p = sub.add_parser("up", help="start the whole stack on this host",
                       description="Start nats-server and valkey-server (unless URLs are "
                                   "given), the prefill and decode instances (or colocated "
                                   "workers) and the gateway, each its own process.")
    p.add_argument("--mode", choices=["disaggregated", "colocated"], default="disaggregated")
    p.add_argument("--prefill", type=int, default=1, help="prefill instances")
    p.add_argument("--decode", type=int, default=1, help="decode instances")
    p.add_argument("--replicas", type=int, default=1, help="colocated workers")
    p.add_argument("--chunked-prefill", action="store_true",
                   help="colocated workers use chunked prefill (Sarathi-style)")
    p.add_argument("--port", type=int, default=8000, help="gateway port")
    p.add_argument("--nats-url", help="use this NATS server instead of starting one")
    p.add_argument("--redis-url", help="use this Redis/Valkey server instead of starting one")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--kv-cache-mb", type=int, default=256, help="KV pool per worker (MiB)")
    p.add_argument("--run-dir", type=Path, default=Path("runs"), help="logs and traces")
    p.add_argument("--planner", choices=["off", "auto"], default="off",
                   help="auto: run the workload profiler and the planner, which re-plans on a "
                        "workload shift and starts/drains instances (disaggregated only)")
    p.add_argument("--devices", type=int, default=0,
                   help="the planner's device budget (default: the number of CPU cores)")
    p.add_argument("--ttft", type=float, default=5.0, help="the planner's TTFT objective (s)")
    p.add_argument("--tpot", type=float, default=0.2, help="the planner's TPOT objective (s)")
    p.set_defaults(parser=p, run=run)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if min(args.prefill, args.decode, args.replicas) < 1:
        parser.error("--prefill, --decode and --replicas must be at least 1")
    if args.planner == "auto" and args.mode != "disaggregated":
        parser.error("--planner auto plans prefill and decode instances: use it with "
                     "--mode disaggregated")
    if args.ttft <= 0 or args.tpot <= 0 or args.devices < 0:
        parser.error("--ttft and --tpot must be positive, --devices at least 0")
    planner_env = {"DS_PLANNER_DEVICES": str(args.devices),
                   "DS_PLANNER_TTFT_S": str(args.ttft), "DS_PLANNER_TPOT_S": str(args.tpot)}
    stack = Stack(StackConfig(mode=args.mode, prefill=args.prefill, decode=args.decode,
                              replicas=args.replicas, port=args.port, nats_url=args.nats_url,
                              redis_url=args.redis_url, model=args.model, threads=args.threads,
                              kv_cache_mb=args.kv_cache_mb, chunked_prefill=args.chunked_prefill,
                              run_dir=args.run_dir, planner=args.planner == "auto",
                              extra_env=planner_env if args.planner == "auto" else {}))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"starting {args.mode} stack (logs in {stack.run_dir}) ...", flush=True)
    try:
        stack.start()
        print(f"ready: {stack.url}/v1  (OpenAI API; Ctrl-C to stop)", flush=True)
        stop.wait()
    finally:
        print("stopping ...", flush=True)
        stack.stop()
    return 0

"""`distserve up`: the whole stack on this host, until Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import http.client
import logging
import os
import signal
import sys
import threading
import urllib.request
from pathlib import Path
from typing import Any

from distserve.commands.common import (
    first_error,
    non_negative_int,
    positive_float,
    positive_int,
    without_password,
)
from services.devices import workers_on_gpu
from services.launcher import (
    Stack,
    StackConfig,
    StartError,
    gateway_host,
    nats_problem,
    redis_problem,
)
from services.planner.modes import MODES, SWITCH_MARGIN, parse_modes
from services.supervisor import port_problem
from shared.engine.config import DTYPE_NAMES, WEIGHT_FORMATS, ModelConfig


def register(sub: Any) -> None:
    p = sub.add_parser("up", help="start the whole stack on this host",
                       description="Start nats-server and valkey-server (unless URLs are "
                                   "given), the prefill and decode instances (or colocated "
                                   "workers) and the gateway, each its own process.")
    p.add_argument("--mode", choices=["disaggregated", "colocated"], default="disaggregated")
    p.add_argument("--prefill", type=positive_int,
                   help="prefill instances (--mode disaggregated; default: 1)")
    p.add_argument("--decode", type=positive_int,
                   help="decode instances (--mode disaggregated; default: 1)")
    p.add_argument("--replicas", type=positive_int,
                   help="colocated workers (--mode colocated; default: 1)")
    p.add_argument("--chunked-prefill", action="store_true",
                   help="colocated workers use chunked prefill (Sarathi-style)")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="compute every prompt whole: by default a worker reuses the KV blocks "
                        "of a prompt's start that an earlier request computed (a shared "
                        "system prompt, a conversation's earlier turns)")
    p.add_argument("--port", type=int, default=8000, help="gateway port")
    p.add_argument("--nats-url", help="use this NATS server instead of starting one")
    p.add_argument("--redis-url", help="use this Redis/Valkey server instead of starting one")
    p.add_argument("--model", default="smollm2-135m",
                   help="built-in model name, path to a .gguf, or a Hugging Face model "
                        "directory (config.json, *.safetensors, tokenizer.json); default: "
                        "%(default)s")
    p.add_argument("--served-model-name", default="",
                   help="the model name clients send (default: the directory's name, or the "
                        "model as given)")
    p.add_argument("--threads", type=non_negative_int, default=1, help="torch threads per worker")
    p.add_argument("--weights", default="auto", choices=list(WEIGHT_FORMATS),
                   help="every worker's weight format: auto (floats), int8 or int4 (CPU "
                        "quantized matmuls; default: %(default)s)")
    p.add_argument("--prefill-weights", choices=list(WEIGHT_FORMATS),
                   help="the prefill instances' (default: --weights); prefill is "
                        "compute-bound and runs fastest on floats")
    p.add_argument("--decode-weights", choices=list(WEIGHT_FORMATS),
                   help="the decode instances' (default: --weights); decode reads every "
                        "weight a step, so int4 steps faster; the KV stays float either way")
    p.add_argument("--dtype", default="auto", choices=list(DTYPE_NAMES),
                   help="every worker's compute dtype (auto: float32 on a CPU, bfloat16 or "
                        "float16 on a GPU; default: %(default)s)")
    p.add_argument("--prefill-dtype", choices=list(DTYPE_NAMES),
                   help="the prefill instances' (default: --dtype): on a CPU with bfloat16 "
                        "dot products (AVX512_BF16, AMX) bfloat16 prefills faster; a CPU "
                        "instance keeps its KV in float32 whatever it computes in, so any "
                        "CPU decode instance takes it (quantized weights compute in float32)")
    p.add_argument("--decode-dtype", choices=list(DTYPE_NAMES),
                   help="the decode instances' (default: --dtype)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks of every worker: processes splitting each "
                        "layer's heads (CPU; --threads is shared by them); must divide the "
                        "model's KV heads (default: %(default)s; with --planner auto, "
                        "a role whose tp and pp stay 1 gets the tp its plan chooses from "
                        "the profile's)")
    p.add_argument("--prefill-tp", type=int, default=0, metavar="N",
                   help="the prefill instances' ranks (default: --tp)")
    p.add_argument("--decode-tp", type=int, default=0, metavar="N",
                   help="the decode instances' ranks (default: --tp); KV moves between "
                        "instances of any tp and pp")
    p.add_argument("--pp", type=int, default=1,
                   help="pipeline stages of every worker, each a run of layers on --tp "
                        "ranks of its own (default: %(default)s)")
    p.add_argument("--prefill-pp", type=int, default=0, metavar="N",
                   help="the prefill instances' stages (default: --pp)")
    p.add_argument("--decode-pp", type=int, default=0, metavar="N",
                   help="the decode instances' stages (default: --pp)")
    p.add_argument("--plan", type=Path, metavar="PLAN_JSON",
                   help="start exactly the instances of a plan written by `distserve plan -o`: "
                        "its mode and each phase's instance count, tp and pp (these override "
                        "--mode, --prefill, --decode, --replicas, --chunked-prefill and the tp "
                        "and pp flags)")
    p.add_argument("--kv-cache-mb", type=positive_int, default=256,
                   help="KV pool per worker, per rank with --tp (MiB)")
    p.add_argument("--run-dir", type=Path, default=Path("runs"), help="logs and traces")
    p.add_argument("--planner", choices=["off", "auto"], default="off",
                   help="auto: run the workload profiler and the planner, which re-plans on a "
                        "workload shift and starts/drains workers, switching modes where "
                        "another serves enough more (the --mode given is where it starts)")
    p.add_argument("--planner-modes", default=",".join(MODES), metavar="MODES",
                   help="the modes the planner may deploy, comma-separated (default: %(default)s;"
                        " it weighs all of them either way)")
    p.add_argument("--switch-margin", type=float, default=SWITCH_MARGIN,
                   help="the planner switches modes only for this many times the goodput "
                        "(default: %(default)s)")
    p.add_argument("--devices", type=int, default=0,
                   help="the planner's device budget (default: the number of CPU cores)")
    p.add_argument("--prefill-profile", type=Path, metavar="PATH",
                   help="with --planner auto: a profile measured in --prefill-dtype (`distserve "
                        "profile --dtype`) that prices the disaggregated prefill instances; "
                        "--plan gives its own (DS_PLANNER_PREFILL_PROFILE)")
    p.set_defaults(plan_prefill_profile=None)  # the plan's, with --plan (apply_plan)
    p.add_argument("--ttft", type=positive_float, default=5.0,
                   help="the planner's TTFT objective (s)")
    p.add_argument("--tpot", type=positive_float, default=0.2,
                   help="the planner's TPOT objective (s)")
    p.add_argument("--api-key", action="append", metavar="KEY",
                   help="the API requires this key (Authorization: Bearer KEY); repeat it for "
                        "several keys. A key on the command line shows in `ps`: prefer "
                        "--api-key-file, or DS_API_KEYS (comma-separated), which is read "
                        "when neither flag is given. No key: the API is open")
    p.add_argument("--api-key-file", type=Path, metavar="PATH",
                   help="the API requires one of the keys in this file (one a line; blank "
                        "lines and # comments are ignored)")
    p.set_defaults(parser=p, run=run)


def read_key_file(path: Path, parser: argparse.ArgumentParser) -> list[str]:
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        parser.error(f"cannot read --api-key-file {path}: {e.strerror}")
    keys = [line.split("#", 1)[0].strip() for line in lines]
    if not any(keys):
        parser.error(f"--api-key-file {path} holds no key")
    return [key for key in keys if key]


def api_keys(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """--api-key and --api-key-file together; without either, the comma-separated
    DS_API_KEYS variable; none of them: the API is open."""
    if args.api_key is None and args.api_key_file is None:
        return [key.strip() for key in os.environ.get("DS_API_KEYS", "").split(",")
                if key.strip()]
    file_keys = [] if args.api_key_file is None else read_key_file(args.api_key_file, parser)
    return [*(args.api_key or []), *file_keys]


def apply_plan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """The instances of the plan file `args.plan`, as if given by flags."""
    from pydantic import ValidationError

    from services.planner.plan import Plan, named_file

    try:
        plan = Plan.model_validate_json(args.plan.read_text())
    except (OSError, UnicodeDecodeError) as e:
        parser.error(f"--plan {args.plan}: not a plan from `distserve plan -o`: cannot read "
                     f"it: {e}")
    except ValidationError as e:
        parser.error(f"--plan {args.plan}: not a plan from `distserve plan -o`: "
                     f"{first_error(e)}")
    if plan.dtype and args.dtype not in ("auto", plan.dtype):
        print(f"the plan priced its workers in {plan.dtype}; starting them in {args.dtype} as "
              "--dtype says", file=sys.stderr)
    elif plan.dtype:
        args.dtype = plan.dtype  # as priced
    if plan.mode == "disaggregated":
        assert plan.prefill is not None and plan.decode is not None
        args.mode, args.prefill, args.decode = "disaggregated", plan.prefill.count, \
            plan.decode.count
        args.prefill_tp, args.decode_tp = plan.prefill.tp, plan.decode.tp
        args.prefill_pp, args.decode_pp = plan.prefill.pp, plan.decode.pp
        if plan.prefill_dtype and args.prefill_dtype not in (None, plan.prefill_dtype):
            print(f"the plan priced its prefill instances in {plan.prefill_dtype}; starting "
                  f"them in {args.prefill_dtype} as --prefill-dtype says", file=sys.stderr)
        args.prefill_dtype = args.prefill_dtype or plan.prefill_dtype or None  # as priced
        if plan.prefill_profile and args.planner == "auto" and args.prefill_profile is None \
                and args.prefill_dtype == plan.prefill_dtype:  # priced online as planned
            args.plan_prefill_profile = named_file(args.plan, plan.prefill_profile)
    else:
        assert plan.colocated is not None
        args.mode, args.replicas = "colocated", plan.colocated.count
        args.tp, args.pp = plan.colocated.tp, plan.colocated.pp
        args.chunked_prefill = plan.mode == "chunked"


def prefill_profile_problem(args: argparse.Namespace, path: Path) -> str | None:
    """Why the online planner could not price the prefill instances `args` start on the
    profile at `path` (None: it can): `load_prefill_profile`'s refusals against the planner's
    own profile (DS_PLANNER_PROFILE, else the shipped one for this CPU), or a profile of
    another dtype than those instances compute in."""
    from services.planner.profiles import ProfileError, load_prefill_profile, planner_profile
    from shared.host import cpu_description

    try:
        prefiller = load_prefill_profile(path, planner_profile(
            os.environ.get("DS_PLANNER_PROFILE", ""), args.threads, cpu_description()))
    except (ProfileError, OSError, ValueError) as e:
        return str(e)
    dtype = args.prefill_dtype or args.dtype
    dtype = "float32" if dtype == "auto" else dtype  # a CPU's (a prefill profile is a CPU's)
    if prefiller.dtype != dtype:
        return (f"{path} was measured in {prefiller.dtype}, the prefill instances compute in "
                f"{dtype} (--prefill-dtype)")
    return None


def planner_env(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, str]:
    """The DS_PLANNER_* settings `args` give the planner and the profiler. A
    `--prefill-profile` that cannot price the prefill instances is refused; the plan's
    (`apply_plan`) is left out, said (the planner prices them on its own profile)."""
    try:
        modes = parse_modes(args.planner_modes)
    except ValueError as e:
        parser.error(f"--planner-modes: {e}")
    if args.planner == "auto":  # the planner reads it at start, and stops on a bad one
        from services.planner.profiles import ProfileError, planner_profile
        from shared.host import cpu_description
        try:
            planner_profile(os.environ.get("DS_PLANNER_PROFILE", ""), args.threads,
                            cpu_description())
        except ProfileError as e:
            parser.error(f"the planner's profile (DS_PLANNER_PROFILE): {e}")
    env = {"DS_PLANNER_DEVICES": str(args.devices), "DS_PLANNER_TTFT_S": str(args.ttft),
           "DS_PLANNER_TPOT_S": str(args.tpot), "DS_PLANNER_MODES": ",".join(modes),
           "DS_PLANNER_SWITCH_MARGIN": str(args.switch_margin)}
    if args.prefill_profile is not None and args.planner != "auto":
        parser.error("--prefill-profile prices the planner's prefill instances: give "
                     "--planner auto")
    path = args.prefill_profile or args.plan_prefill_profile
    problem = None if path is None else prefill_profile_problem(args, path)
    if problem is not None and args.prefill_profile is not None:
        parser.error(f"--prefill-profile: {problem}")  # now, not by a planner warning at start
    if problem is not None:
        print(f"the plan's prefill_profile is not used online: {problem}", file=sys.stderr)
    elif path is not None:
        env["DS_PLANNER_PREFILL_PROFILE"] = str(path.resolve())
    return env


COUNTS = {"disaggregated": ("prefill", "decode"), "colocated": ("replicas",)}


def instance_counts(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Refuse an instance count `args.mode` does not start (a plan's replace them all); the
    counts not given: 1 each."""
    unused = [f"--{name}" for mode, names in COUNTS.items() if mode != args.mode
              for name in names if getattr(args, name) is not None]
    if unused and args.plan is None:
        takes = " and ".join(f"--{name}" for name in COUNTS[args.mode])
        parser.error(f"--mode {args.mode} does not take {' or '.join(unused)}: it takes "
                     f"{takes}")
    for names in COUNTS.values():
        for name in names:
            setattr(args, name, getattr(args, name) or 1)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.plan is not None:
        apply_plan(args, parser)
    instance_counts(args, parser)
    if min(args.tp, args.pp) < 1 or min(args.prefill_tp, args.decode_tp, args.prefill_pp,
                                         args.decode_pp) < 0:
        parser.error("--tp and --pp must be at least 1, the per-phase ones at least 1 when "
                     "given")
    if args.ttft <= 0 or args.tpot <= 0 or args.devices < 0 or args.switch_margin < 1:
        parser.error("--ttft and --tpot must be positive, --devices at least 0, "
                     "--switch-margin at least 1")
    env = planner_env(args, parser)
    from shared.engine.meta import read_meta

    if problem := port_problem(args.port, gateway_host()):
        parser.error(f"--port {args.port}: {problem}")

    model = str(Path(args.model).resolve()) if os.path.exists(args.model) else args.model
    try:  # an unknown model or a checkpoint the workers cannot read: say so now
        shape, _ = read_meta(model)
    except ValueError as e:
        parser.error(str(e))
    try:
        config = StackConfig(mode=args.mode, prefill=args.prefill, decode=args.decode,
                             replicas=args.replicas, port=args.port, nats_url=args.nats_url,
                             redis_url=args.redis_url, model=model,
                             served_model_name=args.served_model_name, threads=args.threads,
                             weights=args.weights, prefill_weights=args.prefill_weights or "",
                             decode_weights=args.decode_weights or "", dtype=args.dtype,
                             prefill_dtype=args.prefill_dtype or "",
                             decode_dtype=args.decode_dtype or "", tp=args.tp,
                             pp=args.pp, prefill_tp=args.prefill_tp, decode_tp=args.decode_tp,
                             prefill_pp=args.prefill_pp, decode_pp=args.decode_pp,
                             kv_cache_mb=args.kv_cache_mb, chunked_prefill=args.chunked_prefill,
                             prefix_caching=args.prefix_caching, run_dir=args.run_dir,
                             planner=args.planner == "auto",
                             api_keys=api_keys(args, parser),
                             extra_env=env if args.planner == "auto" else {})
    except ValueError as e:
        parser.error(str(e))
    check_kv_budget(config, shape, parser)
    check_servers(args, parser)
    # the supervisor says here which child crashed and when it is restarted
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    stack = Stack(config)
    stop = threading.Event()

    def stopping(*_: object) -> None:  # the stack drains; a second signal stops it now
        if stop.is_set():
            stack.stop_now()
        stack.begin_stop()
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # SIGHUP: its terminal closed
        signal.signal(sig, stopping)
    print(f"starting {args.mode} stack (logs in {stack.run_dir}) ...", flush=True)
    try:
        stack.start(abort=stop)  # Ctrl-C while starting stops it
    except (StartError, TimeoutError) as e:
        if stop.is_set():
            print("stopped before the stack was ready", flush=True)
            return 0
        print(f"the stack did not start: {e}", file=sys.stderr, flush=True)
        return 1
    try:
        print(f"ready: {stack.url}/v1  (OpenAI API; Ctrl-C to stop)", flush=True)
        if config.api_keys:
            print(f"the API requires a key ({len(config.api_keys)} configured): send "
                  f"'Authorization: Bearer <key>'", flush=True)
        stop.wait()
    finally:
        try:  # a closed stdout (`up | tee`, tee gone) must not skip the drain
            print(stopping_message(in_flight(stack), stack.drain_s) + restarted(stack),
                  flush=True)
        except Exception:
            logging.exception("cannot say how the stack stops")
        finally:
            stack.stop()
    return 0


def stopping_message(requests: int | None, drain_s: float) -> str:
    """What `up` says as it starts to stop: the requests the gateway has in flight (None: it
    did not say), how long their drain may take, and how not to wait for it."""
    what = "requests" if requests is None else \
        f"{requests} request{'' if requests == 1 else 's'}"
    return f"stopping: draining {what} in flight (up to {drain_s:.0f} s); Ctrl-C again to " \
           "stop now"


def in_flight(stack: Stack, timeout_s: float = 1.0) -> int | None:
    """The requests the gateway has admitted and not yet answered (its /metrics), or None
    where it does not say within `timeout_s`."""
    from distserve.bench import scrape

    keys = stack.config.api_keys
    request = urllib.request.Request(f"{stack.url}/metrics", headers={
        "Authorization": f"Bearer {keys[0]}"} if keys else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            text = response.read().decode()
    except (OSError, http.client.HTTPException, ValueError):
        return None
    found = scrape.samples(text, "ds_gateway_inflight")
    return int(found[0][1]) if found else None


def check_kv_budget(config: StackConfig, model: ModelConfig,
                    parser: argparse.ArgumentParser) -> None:
    """Every worker's --kv-cache-mb holds a KV block of `model` (else the worker would stop
    at start), in blocks of the workers' size and the dtype of their device."""
    from pydantic import ValidationError

    from services.process import WorkerSettings

    try:
        block_size = WorkerSettings().block_size  # as the workers read it: DS_BLOCK_SIZE
    except ValidationError:
        return  # a DS_* setting the workers refuse: each says which, as it starts
    try:
        problem = config.kv_problem(model, block_size, workers_on_gpu(os.environ))
    except ValueError as e:  # a tp or pp that cannot split the model
        parser.error(str(e))
    if problem is not None:
        parser.error(problem)


def check_servers(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """The NATS and Redis given by URL answer now: else nothing starts (the workers would
    retry them forever, and the stack would never serve)."""
    for name, url, problem in (("NATS", args.nats_url, nats_problem),
                               ("Redis", args.redis_url, redis_problem)):
        if url is not None and (why := problem(url)) is not None:
            parser.error(f"cannot reach {name} at {without_password(url)}: {why}")


def restarted(stack: Stack) -> str:
    """` (restarted after exiting: decode-0 2x)`, or nothing when no child was."""
    counts = [f"{name} {n}x" for name, n in stack.restarts().items() if n]
    return f" (restarted after exiting: {', '.join(counts)})" if counts else ""

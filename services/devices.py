"""Which devices a host's workers run on: the GPUs there are, and which one each worker
starts on (the launcher's workers and those the planner deploys alike)."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from pathlib import Path


def gpu_count(env: Mapping[str, str]) -> int:
    """GPUs the workers may use: none when the run names a device (DS_DEVICE) itself, or
    where no GPU driver is loaded (then torch would find none: not loaded to be told so)."""
    if "DS_DEVICE" in env or not gpu_driver_loaded():
        return 0
    import torch  # only here: the launcher and the planner start without it on a CPU host

    return int(torch.cuda.device_count())


def gpu_driver_loaded(root: Path = Path("/")) -> bool:
    """An NVIDIA driver (its /proc entry or a device node) or ROCm's (/dev/kfd) is here."""
    dev = root / "dev"
    return (root / "proc/driver/nvidia/gpus").is_dir() or (dev / "kfd").exists() or \
        any(dev.glob("nvidia[0-9]*"))


def workers_on_gpu(env: Mapping[str, str]) -> bool:
    """Whether the workers a stack starts with `env` run on GPUs: DS_DEVICE's, else
    `assign_devices` gives each a GPU where there are any."""
    device = env.get("DS_DEVICE", "auto")
    return device.startswith("cuda") or (device == "auto" and gpu_count({}) > 0)


def assign_devices(ranks: Sequence[int], gpus: int) -> list[str]:
    """The first device of each worker, whose `ranks[i]` ranks take that GPU and the next
    ones: round robin over the GPUs (each rank its own while there are enough; an instance's
    KV pool is sized from its budget, so several may share one); "" on a host without GPUs
    (the worker's default device)."""
    starts = list(itertools.accumulate(ranks, initial=0))[:-1]
    return [f"cuda:{start % gpus}" if gpus else "" for start in starts]

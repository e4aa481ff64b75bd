"""The planner's output: instances per phase, their parallelism and their devices."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, model_validator


class InstancePlacement(BaseModel):
    role: Literal["prefill", "decode", "colocated"]
    tp: int
    pp: int
    devices: list[tuple[int, int]] = Field(description="(node, gpu) per device, stage-major")


class PhasePlan(BaseModel):
    tp: int = Field(ge=1)
    pp: int = Field(ge=1)
    count: int = Field(ge=1)
    goodput_rps: float = Field(description="simulated goodput of one instance (or segment)")

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.count


Mode = Literal["disaggregated", "colocated", "chunked"]


ALGORITHMS: dict[str, tuple[str, ...]] = {  # the placement searches that plan each mode
    "disaggregated": ("high-affinity", "low-affinity"), "colocated": ("colocated",),
    "chunked": ("colocated",)}


class ModeCandidate(BaseModel):
    """One serving mode as `distserve plan` weighed it."""

    mode: Mode
    placement: str = Field(description="its instances, e.g. '2 prefill tp2 + 1 decode tp1'")
    devices_used: int = 0
    best_per_device_goodput_rps: float = 0.0
    predicted_attainment: float = 0.0
    served_per_device_rps: float = Field(default=0.0, description="the placement simulated "
                                         "whole: the highest rate it serves at the target, "
                                         "per device (modes are ranked by it)")
    error: str = Field(default="", description="why the mode has no plan (then no figures)")
    prefill_dtype: str = Field(default="", description="disaggregated: the prefill instances' "
                               "compute dtype where it is not the profile's")
    cached_share: float | None = Field(
        default=None, description="of a workload priced with each instance's prefix cache "
        "(--prefix-cache): the share of the prompt tokens its instances find cached, "
        "simulated at the rate")

    @property
    def label(self) -> str:
        return f"{self.mode} (prefill {self.prefill_dtype})" if self.prefill_dtype else self.mode


class Plan(BaseModel):
    version: Literal[1] = 1
    model: str
    algorithm: Literal["high-affinity", "low-affinity", "colocated"]
    mode: Mode = "disaggregated"
    rate_rps: float = Field(gt=0, allow_inf_nan=False)
    ttft_s: float = Field(gt=0, allow_inf_nan=False)
    tpot_s: float = Field(gt=0, allow_inf_nan=False)
    attainment_target: float = Field(gt=0, le=1)
    nodes: int
    gpus_per_node: int
    prefill: PhasePlan | None = None
    decode: PhasePlan | None = None
    colocated: PhasePlan | None = None
    instances: list[InstancePlacement]
    devices_used: int
    per_device_goodput_rps: float = Field(
        description="goodput per device of the chosen configuration at its ideal ratio")
    best_per_device_goodput_rps: float = Field(
        default=0.0, description="the best per-device goodput of any configuration searched, "
        "regardless of the rate (the figure to compare designs by)")
    max_batch_tokens: int = Field(default=0, description="colocated: prompt tokens per step "
                                  "(or chunk budget); 0: vLLM's default, 2048")
    max_running: int = Field(default=0, description="colocated: requests running at most; "
                             "0: vLLM's default, 256")
    predicted_attainment: float = Field(description="simulated attainment of the plan at rate")
    served_per_device_rps: float = Field(
        default=0.0, description="the placement simulated whole (both objectives at once, KV "
        "handoffs, the host's contention): the highest rate it serves at the target, per "
        "device; 0: not computed")
    candidates: list[ModeCandidate] = Field(
        default_factory=list, description="every mode searched (the plan is the best of them)")
    reason: str = ""
    profile: str = Field(default="", description="the profile file the plan was made with")
    dtype: str = Field(default="", description="the compute dtype `profile` was measured in, "
                       "where it says: the workers' as priced")
    prefill_profile: str = Field(default="", description="disaggregated: the profile its "
                                 "prefill instances were priced with, where not `profile`")
    prefill_dtype: str = Field(default="", description="disaggregated: the prefill "
                               "instances' compute dtype (that profile's), where given")
    profile_model: str = ""
    intra_node_gbps: float = 600.0
    inter_node_gbps: float = 25.0

    @model_validator(mode="after")
    def _phases_of_its_mode(self) -> Plan:
        """A plan a user edited by hand is refused where its algorithm is not one of its
        mode's, or its mode lacks its instances."""
        if self.mode == "disaggregated" and (self.prefill is None or self.decode is None):
            raise ValueError("a disaggregated plan needs both prefill and decode")
        if self.mode != "disaggregated" and self.colocated is None:
            raise ValueError(f"a {self.mode} plan needs colocated (its replicas)")
        if self.algorithm not in ALGORITHMS[self.mode]:
            raise ValueError(f"a {self.mode} plan is made by algorithm "
                             f"{' or '.join(ALGORITHMS[self.mode])}, not {self.algorithm}")
        return self

    @property
    def placement(self) -> str:
        def phase(name: str, p: PhasePlan) -> str:
            parallel = "".join(f" {k}{v}" for k, v in (("tp", p.tp), ("pp", p.pp)) if v > 1)
            return f"{p.count} {name}{parallel}"

        if self.colocated is not None:
            return phase("chunked colocated" if self.mode == "chunked" else "colocated",
                         self.colocated)
        return " + ".join(phase(n, p) for n, p in (("prefill", self.prefill),
                                                   ("decode", self.decode)) if p is not None)

    def candidate(self) -> ModeCandidate:
        return ModeCandidate(mode=self.mode, placement=self.placement,
                             devices_used=self.devices_used,
                             best_per_device_goodput_rps=self.best_per_device_goodput_rps,
                             predicted_attainment=self.predicted_attainment,
                             served_per_device_rps=self.served_per_device_rps,
                             prefill_dtype=self.prefill_dtype)


def named_file(plan_file: Path, named: str) -> Path:
    """A file the plan in `plan_file` names (its profile, its prefill profile): `distserve
    plan` records it whole; a relative path (an older or a hand-edited plan) is read from the
    working folder where it is there, else beside the plan file. A whole path that is not
    there (a plan moved, or copied to another host, with its profile) is looked for beside
    the plan file by its name."""
    path = Path(named)
    if path.exists():
        return path
    beside = plan_file.parent / (path.name if path.is_absolute() else path)
    return beside if beside.exists() or not path.is_absolute() else path

"""The planner's output: instances per phase, their parallelism and their devices."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class InstancePlacement(BaseModel):
    role: Literal["prefill", "decode", "colocated"]
    tp: int
    pp: int
    devices: list[tuple[int, int]] = Field(description="(node, gpu) per device, stage-major")


class PhasePlan(BaseModel):
    tp: int
    pp: int
    count: int
    goodput_rps: float = Field(description="simulated goodput of one instance (or segment)")

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.count


class Plan(BaseModel):
    version: Literal[1] = 1
    model: str
    algorithm: Literal["high-affinity", "low-affinity", "colocated"]
    rate_rps: float
    ttft_s: float
    tpot_s: float
    attainment_target: float
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
    predicted_attainment: float = Field(description="simulated attainment of the plan at rate")
    reason: str = ""
    profile: str = Field(default="", description="the profile file the plan was made with")
    profile_model: str = ""
    intra_node_gbps: float = 600.0
    inter_node_gbps: float = 25.0

"""Discrete-event simulator of a disaggregated or a colocated cluster (pure; no clock):
`core` (requests, specs, the event loop, decode batching, results), `disaggregated` and
`colocated` (one file per mode)."""

from services.planner.simulator.colocated import (
    ChunkedInstance,
    ColocatedCluster,
    PrefillFirstInstance,
    simulate_colocated,
)
from services.planner.simulator.core import (
    InstanceSpec,
    Link,
    SimRequest,
    SimResult,
)
from services.planner.simulator.disaggregated import (
    DisaggregatedCluster,
    simulate_decode_only,
    simulate_disaggregated,
)

__all__ = ["ChunkedInstance", "ColocatedCluster", "DisaggregatedCluster", "InstanceSpec",
           "Link", "PrefillFirstInstance", "SimRequest", "SimResult", "simulate_colocated",
           "simulate_decode_only", "simulate_disaggregated"]

"""Planner: latency model, simulator and goodput-optimal placement search (DistServe §4,
Appendix A). Everything here is pure logic: no network, no clock, no device."""

"""Service processes: gateway, prefill, decode, planner, profiler."""

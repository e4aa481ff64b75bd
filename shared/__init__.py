"""The common library: engine, messages, bus, state, KV transfer, telemetry."""

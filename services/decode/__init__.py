"""Decode service: pulls KV over UCX when it has room, continuous batching, streams tokens."""

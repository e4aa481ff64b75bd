"""Prefill service: batches prompts, samples the first token, keeps the KV until pulled."""

"""Inference engine: model runner, paged KV cache, block manager, scheduler, sampler.

Only `model_runner`, `model` and `kv_cache` touch the device; `block_manager`, `request`
and `scheduler` are pure bookkeeping and unit-test without torch.
"""

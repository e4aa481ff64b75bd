"""Instances of several ranks: tensor and pipeline parallelism over torch.distributed (gloo,
on the CPU). Rank 0 is the engine (scheduler, sampler, block manager, service shell); the
other ranks run their part of the model on the inputs rank 0 sends them each step."""

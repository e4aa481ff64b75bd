"""Instances that span devices: tensor parallelism over torch.distributed (gloo on the CPU,
NCCL on GPUs). Rank 0 is the engine (scheduler, sampler, block manager, service shell); the
other ranks run their share of every layer on the inputs rank 0 sends them each step."""

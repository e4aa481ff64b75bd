"""Colocated worker: prefill and decode in one continuous-batching loop (the baseline)."""

"""Profiling: FLOPs, MACs, parameters and latency per module (DeepSpeed's `deepspeed.profiling`)."""

"""Activation checkpointing: DeepSpeed's `deepspeed.checkpointing` API on `torch.utils.checkpoint`."""

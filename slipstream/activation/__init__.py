"""Activation checkpointing: DeepSpeed's `deepspeed.checkpointing` API on `torch.utils.checkpoint`.

`recompute.py` is the module that `slipstream.checkpointing` (and `deepspeed.checkpointing`) names; it has nothing
to do with model checkpoints (slipstream/checkpoint/)."""

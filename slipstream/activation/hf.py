"""Activation checkpointing and activation offload for Hugging Face models, without changing their code.

A `transformers` model checkpoints the layers that carry a `gradient_checkpointing` flag (its
`GradientCheckpointingLayer`s) through the function in their `_gradient_checkpointing_func`, which
`gradient_checkpointing_enable()` sets to `torch.utils.checkpoint`. `checkpoint_hf_layers(model)` sets it to
`slipstream.checkpointing.checkpoint` and turns the flag on, so those layers follow the
`activation_checkpointing` options: with `offload=True` (`cpu_checkpointing`) each layer's input waits in host
memory between its forward and its recomputation (activation/offload.py). The layers recompute only in training
mode with gradients enabled, as in `transformers`.
"""

from __future__ import annotations

from torch import nn

from slipstream.activation import recompute

__all__ = ["checkpoint_hf_layers"]


def checkpoint_hf_layers(model: nn.Module, *, offload: bool | None = None) -> int:
    """Route `model`'s checkpointable layers through `slipstream.checkpointing.checkpoint` and turn their
    checkpointing on; `offload` (when not None) sets `cpu_checkpointing` as `configure(None, checkpoint_in_cpu=offload)`
    does (the other options back to their defaults). Returns how many modules carrying the flag were switched."""
    layers = [
        m for m in model.modules() if m is not model and isinstance(getattr(m, "gradient_checkpointing", None), bool)
    ]
    if not layers:
        raise ValueError(
            f"checkpoint_hf_layers: {type(model).__name__} has no layer with a gradient_checkpointing flag "
            "(transformers' GradientCheckpointingLayer); wrap its blocks in slipstream.checkpointing.checkpoint instead"
        )
    if offload is not None:
        recompute.configure(None, checkpoint_in_cpu=offload)
    for layer in layers:
        layer._gradient_checkpointing_func = recompute.checkpoint  # type: ignore[assignment]
        layer.gradient_checkpointing = True  # type: ignore[assignment]  # a plain bool attribute of the layer
    return len(layers)

"""LoRA fused into the base weights for generation, and taken out again for training.

A LoRA layer computes `base(x) + scaling * B(A(x))`. For generation the hybrid engine adds the delta
`scaling * B @ A` into the base weight once, and the layer skips its LoRA path, so each generated token costs
one matmul per layer instead of three; after generation the delta is subtracted and the LoRA path is back.
Two layer shapes are recognised:

- DeepSpeed-Chat's `LinearLayer_LoRA`: `weight` (out, in), `lora_right_weight` (in, r), `lora_left_weight`
  (r, out), the float `lora_scaling`, and the `fuse_lora` flag its forward reads (True: the base matmul only).
  The delta is `lora_scaling * lora_left_weight.T @ lora_right_weight.T`, as DeepSpeed's hybrid engine adds it.
- PEFT's `LoraLayer` (when `peft` is importable): its own `merge()` / `unmerge()`, which add and subtract
  `scaling * lora_B @ lora_A` of the active adapters and make its forward skip them.

Subtracting the delta gives the weight back up to fp32 rounding, not bit for bit: each element is within
`eps * (|w| + |delta|)` of its value before (one rounding when adding, one when subtracting; `eps` of the
weight's dtype). Where the fused weight is a gathered ZeRO-3 copy the shard itself is never touched (units kept
whole under the persistence threshold have no copy: the bound applies to them).
The functions here work on whole tensors; gathering them at ZeRO-3 is the engine's (engine/weight_handoff.py).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

_CHAT_ATTRS = ("weight", "lora_right_weight", "lora_left_weight", "lora_scaling")


def _peft_layer_type() -> type | None:
    try:
        from peft.tuners.lora import LoraLayer  # optional: present when the user trains with PEFT
    except ImportError:
        return None
    return cast(type, LoraLayer)  # untyped without peft's stubs


def _is_chat_layer(module: nn.Module) -> bool:
    if not all(hasattr(module, name) for name in _CHAT_ATTRS):
        return False
    if not hasattr(module, "fuse_lora"):
        raise TypeError(
            f"{type(module).__name__} has DeepSpeed-Chat's LoRA weights (lora_right_weight, lora_left_weight, "
            "lora_scaling) but no `fuse_lora` flag: its forward would add the LoRA path to the fused weight a "
            "second time. Give the layer a `fuse_lora` attribute its forward reads (True: base matmul only), as "
            "DeepSpeed-Chat's LinearLayer_LoRA has"
        )
    return True


def lora_layers(module: nn.Module) -> list[nn.Module]:
    """The LoRA layers of `module` (DeepSpeed-Chat's or PEFT's), in `modules()` order."""
    peft_type = _peft_layer_type()
    return [m for m in module.modules() if (peft_type is not None and isinstance(m, peft_type)) or _is_chat_layer(m)]


def _chat_delta(layer: nn.Module) -> torch.Tensor:
    left, right = cast(torch.Tensor, layer.lora_left_weight), cast(torch.Tensor, layer.lora_right_weight)
    return float(cast(float, layer.lora_scaling)) * torch.matmul(left.detach().t(), right.detach().t())


def _set_fused(layers: list[nn.Module], fused: bool) -> None:
    with torch.no_grad():
        for layer in layers:
            if not _is_chat_layer(layer):
                getattr(layer, "merge" if fused else "unmerge")()  # PEFT's own, which skips what is done already
            elif bool(layer.fuse_lora) != fused:
                weight = cast(torch.Tensor, layer.weight).data
                delta = _chat_delta(layer).to(weight.dtype)
                weight.add_(delta if fused else -delta)
                layer.fuse_lora = fused  # type: ignore[assignment]


def fuse_lora(layers: list[nn.Module]) -> None:
    """Add each layer's LoRA delta into its base weight and switch its LoRA path off (a fused layer is skipped)."""
    _set_fused(layers, True)


def unfuse_lora(layers: list[nn.Module]) -> None:
    """Subtract each fused layer's LoRA delta from its base weight and switch its LoRA path back on."""
    _set_fused(layers, False)

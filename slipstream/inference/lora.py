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

The tensor-parallel inference copy (hybrid_tp.py) fuses without touching the training model: a LoRA layer
becomes a plain `nn.Linear` there (`linear_stand_in`, its base weight and bias only), and while the copy is
refilled `SliceFusion` adds each layer's deltas (`lora_terms`) into this rank's slice of the copied base weight,
computing only that slice of `B @ A` (see [Note: fusing into a slice]).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
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


@dataclasses.dataclass(frozen=True, slots=True)
class LoraTerm:
    """One adapter's delta `scaling * up @ down` of a base weight (out, in): `up` is (out, r), `down` (r, in)."""

    scaling: float
    up: nn.Parameter
    down: nn.Parameter
    transposed: bool
    """The parameters hold up.T and down.T (DeepSpeed-Chat's lora_left_weight and lora_right_weight)."""
    upcast: bool
    """Computed in fp32 and rounded back to the factors' dtype (PEFT does so for fp16 / bf16 on the CPU)."""

    def delta(
        self, up: torch.Tensor, down: torch.Tensor, dim: int | None = None, start: int = 0, width: int = 0
    ) -> torch.Tensor:
        """The delta from the factors' values; with `dim` only its slice [start, start + width) along `dim`."""
        up, down = (up.t(), down.t()) if self.transposed else (up, down)
        if dim == 0:
            up = up.narrow(0, start, width)
        elif dim == 1:
            down = down.narrow(1, start, width)
        dtype = up.dtype
        if self.upcast:
            up, down = up.float(), down.float()
        return (self.scaling * torch.matmul(up, down)).to(dtype)


def _chat_term(layer: nn.Module) -> LoraTerm:
    left, right = cast(nn.Parameter, layer.lora_left_weight), cast(nn.Parameter, layer.lora_right_weight)
    return LoraTerm(float(cast(float, layer.lora_scaling)), left, right, transposed=True, upcast=False)


def _peft_terms(layer: nn.Module, name: str) -> list[LoraTerm]:
    """The active adapters of a PEFT layer not merged yet; what the split copy cannot fuse is refused."""
    if getattr(layer, "disable_adapters", False):
        return []  # its forward then computes the base layer alone
    terms = []
    merged = set(getattr(layer, "merged_adapters", ()))
    lora_a, lora_b = cast(nn.ModuleDict, layer.lora_A), cast(nn.ModuleDict, layer.lora_B)
    scaling = cast(dict[str, float], layer.scaling)
    for adapter in getattr(layer, "active_adapters", ()):
        if adapter not in lora_a or adapter in merged:
            continue
        unsupported = [
            what
            for what, present in (
                ("a LoRA variant (DoRA and the like)", adapter in getattr(layer, "lora_variant", {})),
                ("lora_bias", bool(getattr(layer, "lora_bias", {}).get(adapter))),
                ("fan_in_fan_out", bool(getattr(layer, "fan_in_fan_out", False))),
            )
            if present
        ]
        if unsupported:
            raise ValueError(
                f"engine.generate with hybrid_engine.inference_tp_size > 1: the PEFT layer {name} (adapter "
                f"{adapter!r}) uses {', '.join(unsupported)}, which the split inference copy does not fuse; merge "
                "the adapter first (merge_and_unload) or set inference_tp_size to 1"
            )
        up, down = cast(nn.Parameter, lora_b[adapter].weight), cast(nn.Parameter, lora_a[adapter].weight)
        upcast = up.device.type == "cpu" and up.dtype in (torch.float16, torch.bfloat16)
        terms.append(LoraTerm(float(scaling[adapter]), up, down, transposed=False, upcast=upcast))
    return terms


def lora_terms(layer: nn.Module, name: str = "") -> list[LoraTerm]:
    """The deltas a fuse would add into `layer`'s base weight now: none when they are in it already."""
    if _is_chat_layer(layer):
        return [] if layer.fuse_lora else [_chat_term(layer)]
    return _peft_terms(layer, name or type(layer).__name__)


def _chat_delta(layer: nn.Module) -> torch.Tensor:
    term = _chat_term(layer)
    return term.delta(term.up.detach(), term.down.detach())


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


def base_parameters(layer: nn.Module, name: str = "") -> dict[str, nn.Parameter]:
    """The base linear's `weight` (and `bias` when it has one) of a LoRA layer."""
    chat = _is_chat_layer(layer)
    base = layer if chat else cast(nn.Module, layer.get_base_layer())  # type: ignore[operator]
    if not chat and not isinstance(base, nn.Linear):
        raise ValueError(
            f"engine.generate with hybrid_engine.inference_tp_size > 1: the PEFT layer {name or type(layer).__name__} "
            f"wraps a {type(base).__name__}; the split inference copy fuses LoRA into linear layers only. Merge "
            "the adapters first (merge_and_unload) or set inference_tp_size to 1"
        )
    found = {"weight": base.weight, "bias": getattr(base, "bias", None)}
    return {key: cast(nn.Parameter, value) for key, value in found.items() if value is not None}


def linear_stand_in(layer: nn.Module, placeholder: Callable[[nn.Parameter], nn.Parameter], name: str = "") -> nn.Linear:
    """The plain linear a fused LoRA layer computes, for an inference copy: `placeholder` of its base weight and
    bias, no LoRA factors (the copy never computes a LoRA path; its weight gets the deltas when refilled)."""
    base = base_parameters(layer, name)
    linear = nn.Linear(1, 1, bias=False, device="meta")
    linear.weight = placeholder(base["weight"])
    if "bias" in base:
        linear.bias = placeholder(base["bias"])
    linear.out_features, linear.in_features = linear.weight.shape
    return linear


@dataclasses.dataclass(frozen=True, slots=True)
class FusedSlice:
    """A rank's slice of a LoRA layer's base weight in an inference copy, which gets the layer's deltas."""

    layer: nn.Module
    name: str
    """The layer's qualified name, for errors."""
    base: nn.Parameter
    target: torch.Tensor
    dim: int | None
    """The dim the slice is cut along; None: the whole weight."""
    start: int


class SliceFusion:
    """The LoRA deltas added into the slices of an inference copy while it is refilled a chunk at a time.

    [Note: fusing into a slice] The refill reads the training parameters in chunks (at ZeRO-3 a few units
    gathered at a time) and copies each rank's slice of every base weight into the copy. After a chunk's slices
    are copied, `add_ready(chunk)` adds `scaling * up @ down`, cut to the slice (rows of `up` for a weight split
    by rows, columns of `down` for one split by columns), into every slice whose base weight and factors have all
    been read; the whole product is never formed, nor a fused copy of the training weight, which stays as it
    was. A factor read in an earlier chunk than the rest of its layer (a unit boundary between them) is kept,
    cloned (rank-r sized), until its slice is done. Adding after the copy rounds as the in-place fuse does:
    once, base + delta.
    """

    def __init__(self, slices: list[FusedSlice]) -> None:
        terms = [(piece, lora_terms(piece.layer, piece.name)) for piece in slices]
        self.pending = [(piece, found) for piece, found in terms if found]
        self.factors = {id(p): p for _, found in self.pending for t in found for p in (t.up, t.down)}
        self.read: set[int] = set()
        self.values: dict[int, torch.Tensor] = {}
        self.kept: set[int] = set()

    def parameters(self) -> list[nn.Parameter]:
        """The factors the refill must read besides the base weights."""
        return list(self.factors.values())

    def add_ready(self, chunk: list[nn.Parameter]) -> None:
        """After `chunk`'s base slices are copied (its values readable): the deltas whose inputs are all read."""
        for param in chunk:
            self.read.add(id(param))
            if id(param) in self.factors:
                self.values[id(param)] = param.detach()
        waiting = []
        for piece, terms in self.pending:
            inputs = [piece.base, *(p for t in terms for p in (t.up, t.down))]
            if not all(id(p) in self.read for p in inputs):
                waiting.append((piece, terms))
                continue
            width = 0 if piece.dim is None else piece.target.shape[piece.dim]
            for term in terms:
                delta = term.delta(self.values[id(term.up)], self.values[id(term.down)], piece.dim, piece.start, width)
                piece.target.add_(delta.to(piece.target.dtype))
        self.pending = waiting
        needed = {id(p) for _, terms in waiting for t in terms for p in (t.up, t.down)}
        for key in [k for k in self.values if k not in needed]:
            del self.values[key]
        for key in needed.intersection(self.values).difference(self.kept):
            self.values[key] = self.values[key].clone()  # its chunk is released next
            self.kept.add(key)

    def finish(self) -> None:
        """Every slice got its deltas (a refill that read every parameter leaves none waiting)."""
        if self.pending:
            layers = ", ".join(piece.name for piece, _ in self.pending)
            raise RuntimeError(f"LoRA slices never fused: the refill did not read every factor of {layers}")

"""FP8 training of linear layers (Slipstream's own; DeepSpeed has none and points to Transformer Engine).

`Float8Linear` keeps its weight in the model's dtype (fp32 or bf16) and runs the three matmuls of a linear
layer in float8 with dynamic scaling: the forward casts the input and the weight to `float8_e4m3fn`, the
backward casts the output gradient to `float8_e5m2` (its wider range for gradients) and recasts the input and
weight along the axis each product contracts. A scale maps a tensor's absolute maximum onto the format's
largest finite value: one per tensor (`tensorwise`) or one per row of the contraction (`rowwise`, torchao's
axiswise scaling). The products run through `torch._scaled_mm` on an accelerator with FP8 (CUDA capability
8.9 or later), or in emulation (the float8 values multiplied in fp32 and the scales factored out, as
_scaled_mm does), which is only for checking correctness on a CPU and must be asked for.

`convert_to_float8_training` swaps a model's nn.Linear modules for it, through torchao's float8 training when
torchao is installed and the hardware has FP8; `apply_fp8_plan` applies the config's `fp8` section.

A tensorwise layer's weight may arrive already cast: its `precast` slot (a `Float8WeightSlot`) then holds the
float8 values and the scale, and the forward and the backward multiply them as they are instead of casting the
weight again. ZeRO-3 fills it when it gathers the weight in float8 (zero/stage3/fp8_gather.py).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch
from torch import nn

from slipstream.accelerator import get_accelerator
from slipstream.config.precision_plans import Fp8Plan
from slipstream.config.schema.precision import FP8_RECIPES

__all__ = [
    "RECIPES",
    "Float8Linear",
    "Float8WeightSlot",
    "cast_scaled_fp8",
    "float8_gather_slots",
    "fp8_scale_of_amax",
    "apply_fp8_plan",
    "convert_to_float8_training",
    "fp8_hardware",
    "fp8_scale",
    "quantize_fp8",
]

RECIPES = FP8_RECIPES
E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
_EPS = 1e-12
ModuleFilter = Callable[[nn.Module, str], bool]


def fp8_hardware() -> bool:
    """The accelerator multiplies float8 (torch._scaled_mm): CUDA with compute capability 8.9 or later."""
    if get_accelerator().name != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability() >= (8, 9)


def fp8_scale(tensor: torch.Tensor, dtype: torch.dtype, axis: int | None) -> torch.Tensor:
    """fp8_max / amax, fp32: over the whole tensor (axis None, a 0-d scale) or along `axis` (kept as size 1)."""
    absolute = tensor.detach().abs()
    amax = absolute.amax() if axis is None else absolute.amax(dim=axis, keepdim=True)
    return fp8_scale_of_amax(amax, dtype)


def fp8_scale_of_amax(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8_max / amax (fp32, elementwise): the scale that maps a largest magnitude onto the format's largest value."""
    return torch.finfo(dtype).max / amax.float().clamp(min=_EPS)


def cast_scaled_fp8(scaled: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """`scaled` (fp32 values already times their scale) saturated to the format's range, in place, and cast to
    `dtype` (into `out` when given, a float8 tensor of the same shape)."""
    limit = torch.finfo(dtype).max
    scaled.clamp_(-limit, limit)
    if out is None:
        return scaled.to(dtype)
    return out.copy_(scaled)


def quantize_fp8(tensor: torch.Tensor, dtype: torch.dtype, axis: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The float8 values of `tensor * scale` (saturated to the format's range) and the scale."""
    scale = fp8_scale(tensor, dtype, axis)
    return cast_scaled_fp8(tensor.float() * scale, dtype), scale


def _pad_rows(tensor: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero rows appended up to a multiple (zero rows add nothing to a product that contracts them)."""
    extra = -tensor.shape[0] % multiple
    return tensor if extra == 0 else torch.cat([tensor, tensor.new_zeros(extra, *tensor.shape[1:])])


def _fp8_matmul(
    a: torch.Tensor,
    a_dtype: torch.dtype,
    b: torch.Tensor,
    b_dtype: torch.dtype,
    rowwise: bool,
    emulate: bool,
    b_cast: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """a @ b.T (a: M x K, b: N x K) with both operands in float8, scaled along K when rowwise; fp32 result.
    `b_cast`: b already in float8 with its tensorwise scale (a precast weight; K is then a multiple of 16).
    _scaled_mm wants K a multiple of 16: K is padded with zeros when it is not (the weight-gradient product
    contracts the tokens)."""
    if not emulate and a.shape[1] % 16:
        a, b = _pad_rows(a.t(), 16).t(), _pad_rows(b.t(), 16).t()
    axis = 1 if rowwise else None
    qa, scale_a = quantize_fp8(a, a_dtype, axis)
    qb, scale_b = quantize_fp8(b, b_dtype, axis) if b_cast is None else b_cast
    inverse_a, inverse_b = scale_a.reciprocal(), scale_b.reciprocal().t() if rowwise else scale_b.reciprocal()
    if emulate:  # as _scaled_mm computes it: the float8 product, then the scales factored out of it
        return (qa.float() @ qb.float().t()) * (inverse_a * inverse_b)
    out_dtype = torch.bfloat16 if rowwise else torch.float32
    result = torch._scaled_mm(
        qa.contiguous(), qb.contiguous().t(), scale_a=inverse_a, scale_b=inverse_b, out_dtype=out_dtype
    )
    return result.float()


class Float8WeightSlot:
    """A tensorwise layer's weight already cast to float8 elsewhere (ZeRO-3's float8 all-gather fills it while
    the weight is gathered and empties it when the weight is freed): the float8 values, in the weight's shape,
    and the fp32 0-d scale they were cast with; empty (None) otherwise."""

    __slots__ = ("scale", "values")

    def __init__(self) -> None:
        self.values: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None

    def fill(self, values: torch.Tensor, scale: torch.Tensor) -> None:
        self.values, self.scale = values, scale

    def empty(self) -> None:
        self.values = self.scale = None

    def cast(self, *, transposed: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(float8 values, scale) -- of the transposed weight when asked (a tensorwise scale is the same) -- or None."""
        if self.values is None or self.scale is None:
            return None
        return (self.values.t() if transposed else self.values), self.scale


class _Float8LinearFunction(torch.autograd.Function):
    """y = x W^T in float8; the backward's two products in float8 with the gradient in e5m2. The weight's
    float8 values come from `precast` when it holds them (read at the forward and again at the backward)."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        weight: torch.Tensor,
        rowwise: bool,
        emulate: bool,
        precast: Float8WeightSlot | None,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.rowwise, ctx.emulate, ctx.precast = rowwise, emulate, precast  # type: ignore[attr-defined]
        cast = None if precast is None else precast.cast()
        return _fp8_matmul(x, E4M3, weight, E4M3, rowwise, emulate, cast).to(x.dtype)

    @staticmethod
    def backward(
        ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None]:
        x, weight = ctx.saved_tensors  # type: ignore[attr-defined]
        rowwise, emulate, precast = ctx.rowwise, ctx.emulate, ctx.precast  # type: ignore[attr-defined]
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:  # type: ignore[attr-defined]
            cast = None if precast is None else precast.cast(transposed=True)
            grad_x = _fp8_matmul(grad, E5M2, weight.t(), E4M3, rowwise, emulate, cast).to(x.dtype)
        if ctx.needs_input_grad[1]:  # type: ignore[attr-defined]
            grad_w = _fp8_matmul(grad.t(), E5M2, x.t(), E4M3, rowwise, emulate).to(weight.dtype)
        return grad_x, grad_w, None, None, None


class Float8Linear(nn.Linear):
    """An nn.Linear whose matmuls run in float8 (see the module docstring); weight and bias keep their dtype.
    `emulate=True` computes on any device (for correctness checks); otherwise the accelerator must have FP8."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        recipe: str = "tensorwise",
        emulate: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.recipe = _checked_recipe(recipe)
        self.emulate = emulate
        self.precast = Float8WeightSlot()
        """The weight cast to float8 elsewhere, used as it is while it holds values (tensorwise only)."""
        if not emulate:
            _require_fp8_hardware()

    @classmethod
    def from_float(cls, linear: nn.Linear, *, recipe: str = "tensorwise", emulate: bool = False) -> Float8Linear:
        """The same parameters (shared, not copied) behind a Float8Linear."""
        with torch.device("meta"):
            new = cls(linear.in_features, linear.out_features, linear.bias is not None, recipe=recipe, emulate=True)
        new.emulate = emulate
        new.weight, new.bias = linear.weight, linear.bias
        return new

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        flat = input.reshape(-1, self.in_features)
        rowwise = self.recipe == "rowwise"
        matmul = _Float8LinearFunction.apply
        precast = None if rowwise else self.precast
        out: torch.Tensor = matmul(flat, self.weight, rowwise, self.emulate, precast)  # type: ignore[no-untyped-call]
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.reshape(*input.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}, emulate={self.emulate}"


def float8_gather_slots(model: nn.Module) -> dict[int, Float8WeightSlot]:
    """id(weight) -> its layer's slot, for the tensorwise Float8Linear layers of `model` (with both dims
    multiples of 16): the weights ZeRO-3 may gather in float8 (a rowwise scale is per row of the whole weight,
    which a rank's flat slice does not hold, so rowwise layers gather exactly and cast themselves)."""
    return {
        id(module.weight): module.precast
        for module in model.modules()
        if isinstance(module, Float8Linear)
        and module.recipe == "tensorwise"
        and not (module.in_features % 16 or module.out_features % 16)
    }


def _checked_recipe(recipe: str) -> str:
    if recipe not in RECIPES:
        raise ValueError(f"fp8 recipe={recipe!r} is not one of {RECIPES}; use 'tensorwise' or 'rowwise'")
    return recipe


def _require_fp8_hardware() -> None:
    if not fp8_hardware():
        raise RuntimeError(
            f"Float8Linear: the accelerator ({get_accelerator().name}) has no FP8 matmul (needs CUDA compute "
            "capability 8.9 or later); pass emulate=True (fp8.emulate in the config) to emulate it, for "
            "correctness checks only"
        )


def _convertible(module: nn.Module, fqn: str, module_filter_fn: ModuleFilter | None) -> bool:
    """An nn.Linear (not already converted) with both dims multiples of 16 that the filter accepts."""
    if type(module) is not nn.Linear or module.in_features % 16 or module.out_features % 16:
        return False
    return module_filter_fn is None or module_filter_fn(module, fqn)


def convert_to_float8_training(
    model: nn.Module, recipe: str = "tensorwise", module_filter_fn: ModuleFilter | None = None, emulate: bool = False
) -> nn.Module:
    """Swap `model`'s nn.Linear modules for Float8Linear in place (and return it), skipping those whose
    dimensions are not multiples of 16 and those `module_filter_fn(module, fqn)` rejects. With torchao
    installed and FP8 hardware, torchao's float8 training does the swap; without FP8 hardware only
    `emulate=True` converts."""
    _checked_recipe(recipe)
    if not emulate:
        _require_fp8_hardware()
        if importlib.util.find_spec("torchao") is not None:
            return _torchao_convert(model, recipe, module_filter_fn)
    for fqn, module in list(model.named_modules()):
        for name, child in list(module.named_children()):
            child_fqn = f"{fqn}.{name}" if fqn else name
            if isinstance(child, nn.Linear) and _convertible(child, child_fqn, module_filter_fn):
                setattr(module, name, Float8Linear.from_float(child, recipe=recipe, emulate=emulate))
    return model


def _torchao_convert(model: nn.Module, recipe: str, module_filter_fn: ModuleFilter | None) -> nn.Module:
    from torchao.float8 import Float8LinearConfig
    from torchao.float8 import convert_to_float8_training as torchao_convert

    config = Float8LinearConfig.from_recipe_name(recipe)
    converted: nn.Module = torchao_convert(
        model, config=config, module_filter_fn=lambda module, fqn: _convertible(module, fqn, module_filter_fn)
    )
    return converted


def apply_fp8_plan(model: nn.Module, plan: Fp8Plan | None) -> nn.Module:
    """The config's `fp8` section applied to `model` (the engine calls it before ZeRO wraps the model): its
    linear layers converted, except those named in `exclude_modules` (a name or a prefix of one)."""
    if plan is None:
        return model
    excluded = plan.exclude_modules

    def keep_others(_module: nn.Module, fqn: str) -> bool:
        return not any(fqn == name or fqn.startswith(f"{name}.") for name in excluded)

    return convert_to_float8_training(model, recipe=plan.recipe, module_filter_fn=keep_others, emulate=plan.emulate)

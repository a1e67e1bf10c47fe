"""CompressedLinear and CompressedConv2d: layers whose forward uses their weight fake-quantized and/or masked."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn

from slipstream.compression.activation import InputQuantizer, quantize_inputs
from slipstream.compression.masks import StructuredMask, unit_norms
from slipstream.compression.plan import ActivationPlan, GroupPlan, PruningPlan, QuantizationPlan, StructuredPlan
from slipstream.compression.quantize import fake_quantize, l1_mask

__all__ = ["BitSchedule", "CompressedConv2d", "CompressedLinear", "enable_activation_quantization"]


@dataclass
class BitSchedule:
    """A layer's current bit width and the step (counted from schedule_offset) of its next drop.

    At the drop the width falls by one bit and the period doubles (DeepSpeed's MoQ schedule), until
    target_bits. With quantize_weight_in_forward the width is target_bits from the start, as in DeepSpeed.
    """

    bits: int
    target_bits: int
    period: int

    def advance(self, steps_since_offset: int) -> None:
        """Drop one bit per period passed by `steps_since_offset` (a scheduler step passes at most one)."""
        if self.bits > self.target_bits and steps_since_offset >= self.period:
            self.bits -= 1
            self.period <<= 1


def _enabled(mask: StructuredMask | None) -> torch.Tensor | None:
    """The unit mask when that pruning is on, else None."""
    return None if mask is None or not mask.enabled else mask.mask()


def enable_activation_quantization(layer: nn.Linear | nn.Conv2d, plan: ActivationPlan, group: GroupPlan) -> None:
    """Quantize `layer`'s input at the group's bits once the scheduler reaches the plan's offset (ranges per
    row of a Linear's input, per sample of a Conv2d's)."""
    per_sample = isinstance(layer, nn.Conv2d)
    quantize_inputs(layer, InputQuantizer(plan, group.bits, per_sample=per_sample, device=layer.weight.device))


def _carry_input_quantizer(layer: nn.Module, plain: nn.Module) -> None:
    """redundancy_clean: the plain layer keeps `layer`'s activation quantization (its state too)."""
    quantizer = getattr(layer, "input_quantizer", None)
    if isinstance(quantizer, InputQuantizer):
        quantize_inputs(plain, quantizer)


class CompressedLinear(nn.Linear):
    """The same parameters as the nn.Linear it replaces; forward quantizes, then masks, the weight.

    Masks, each on from its method's schedule_offset: sparse (elements), row (output rows and their bias),
    head (the columns of each of `num_heads` equal slices of the input: an attention output projection's heads).
    With activation quantization its `input_quantizer` runs on the input first (activation.py).
    """

    def __init__(self, linear: nn.Linear) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.quantization: QuantizationPlan | None = None
        self.schedule: BitSchedule | None = None
        self.quantization_enabled = False
        self.pruning_enabled = False
        self.register_buffer("sparse_pruning_mask", None)
        self.sparse_pruning: StructuredMask | None = None
        self.row_pruning: StructuredMask | None = None
        self.head_pruning: StructuredMask | None = None
        self.num_heads = 0

    def enable_quantization(self, plan: QuantizationPlan, group: GroupPlan) -> None:
        """Quantize this layer's weight per `group` once the scheduler reaches the plan's offset."""
        self.quantization = plan
        start = group.target_bits if plan.in_forward else group.start_bits
        self.schedule = BitSchedule(start, group.target_bits, group.quantization_period)

    def enable_pruning(self, plan: PruningPlan, group: GroupPlan) -> None:
        """l1: fix the mask now (from the weight as it is); topk: one learned score per element (a parameter,
        `sparse_pruning.scores`). Applied once the scheduler reaches the offset."""
        if plan.method == "l1":
            self.sparse_pruning_mask = l1_mask(self.weight, group.dense_ratio)
        else:
            self.sparse_pruning = StructuredMask("topk", group.dense_ratio, self.weight, tuple(self.weight.shape))

    def enable_structured(self, plan: StructuredPlan, group: GroupPlan, name: str) -> None:
        """Row or head pruning of this layer per `group` (l1 masks fixed now from the weight as it is)."""
        if plan.name == "row_pruning":
            norms = unit_norms(self.weight)
            self.row_pruning = StructuredMask(plan.method, group.dense_ratio, norms, (self.out_features, 1))
            return
        if self.in_features % plan.num_heads:
            raise ValueError(
                f"compression_training.head_pruning: num_heads {plan.num_heads} does not divide the "
                f"{self.in_features} input features of {name!r}; name the attention output projection and "
                "give its number of heads"
            )
        self.num_heads = plan.num_heads
        heads = torch.zeros(plan.num_heads, device=self.weight.device)
        self.head_pruning = StructuredMask(plan.method, group.dense_ratio, heads, (1, plan.num_heads))

    def compressed_weight(self) -> torch.Tensor:
        """The weight forward uses at this step."""
        weight = self.weight
        plan, schedule = self.quantization, self.schedule
        if self.quantization_enabled and plan is not None and schedule is not None:
            weight = fake_quantize(
                weight,
                schedule.bits,
                plan.groups,
                symmetric=plan.symmetric,
                stochastic=plan.stochastic and self.training,
            )
        if self.pruning_enabled and self.sparse_pruning_mask is not None:
            weight = weight * self.sparse_pruning_mask
        if self.pruning_enabled and self.sparse_pruning is not None:
            weight = weight * self.sparse_pruning.mask().view_as(weight)
        rows, heads = _enabled(self.row_pruning), _enabled(self.head_pruning)
        if rows is not None:
            weight = weight * rows.view(-1, 1)
        if heads is not None:
            weight = (weight.view(self.out_features, self.num_heads, -1) * heads.view(1, -1, 1)).flatten(1)
        return weight

    def compressed_bias(self) -> torch.Tensor | None:
        """The bias forward uses: zero at pruned rows."""
        rows = _enabled(self.row_pruning)
        return self.bias if rows is None or self.bias is None else self.bias * rows

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(input, self.compressed_weight(), self.compressed_bias())

    def cleaned(self) -> nn.Linear:
        """A plain nn.Linear holding the weight and bias forward uses now (redundancy_clean)."""
        plain = nn.Linear(
            self.in_features,
            self.out_features,
            bias=self.bias is not None,
            device=self.weight.device,
            dtype=self.weight.dtype,
        )
        _carry_input_quantizer(self, plain)
        return _baked(plain, self.compressed_weight(), self.compressed_bias())


Plain = TypeVar("Plain", nn.Linear, nn.Conv2d)


def _baked(plain: Plain, weight: torch.Tensor, bias: torch.Tensor | None) -> Plain:
    with torch.no_grad():
        plain.weight.copy_(weight)
        if bias is not None and plain.bias is not None:
            plain.bias.copy_(bias)
    return plain


class CompressedConv2d(nn.Conv2d):
    """The same parameters as the nn.Conv2d it replaces; forward masks whole output channels (and their bias)
    from channel pruning's schedule_offset on."""

    def __init__(self, conv: nn.Conv2d) -> None:
        nn.Module.__init__(self)
        for key, value in vars(conv).items():
            if not key.startswith("_"):
                setattr(self, key, value)
        self._reversed_padding_repeated_twice = conv._reversed_padding_repeated_twice
        self.weight, self.bias = conv.weight, conv.bias
        self.channel_pruning: StructuredMask | None = None

    def enable_structured(self, plan: StructuredPlan, group: GroupPlan, name: str) -> None:
        """Channel pruning of this layer per `group` (an l1 mask fixed now from the weight as it is)."""
        shape = (self.out_channels, 1, 1, 1)
        self.channel_pruning = StructuredMask(plan.method, group.dense_ratio, unit_norms(self.weight), shape)

    def compressed_weight(self) -> torch.Tensor:
        channels = _enabled(self.channel_pruning)
        return self.weight if channels is None else self.weight * channels.view(-1, 1, 1, 1)

    def compressed_bias(self) -> torch.Tensor | None:
        channels = _enabled(self.channel_pruning)
        return self.bias if channels is None or self.bias is None else self.bias * channels

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(input, self.compressed_weight(), self.compressed_bias())

    def cleaned(self) -> nn.Conv2d:
        """A plain nn.Conv2d holding the weight and bias forward uses now (redundancy_clean)."""
        plain = nn.Conv2d(
            self.in_channels,
            self.out_channels,
            self.kernel_size,  # type: ignore[arg-type]
            stride=self.stride,  # type: ignore[arg-type]
            padding=self.padding,  # type: ignore[arg-type]
            dilation=self.dilation,  # type: ignore[arg-type]
            groups=self.groups,
            bias=self.bias is not None,
            padding_mode=self.padding_mode,
            device=self.weight.device,
            dtype=self.weight.dtype,
        )
        _carry_input_quantizer(self, plain)
        return _baked(plain, self.compressed_weight(), self.compressed_bias())

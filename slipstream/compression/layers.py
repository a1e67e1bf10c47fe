"""CompressedLinear: an nn.Linear whose forward uses its weight fake-quantized and/or masked."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from slipstream.compression.plan import GroupPlan, QuantizationPlan
from slipstream.compression.quantize import fake_quantize, l1_mask

__all__ = ["BitSchedule", "CompressedLinear"]


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


class CompressedLinear(nn.Linear):
    """The same parameters as the nn.Linear it replaces; forward quantizes, then masks, the weight."""

    def __init__(self, linear: nn.Linear) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.quantization: QuantizationPlan | None = None
        self.schedule: BitSchedule | None = None
        self.quantization_enabled = False
        self.pruning_enabled = False
        self.register_buffer("sparse_pruning_mask", None)

    def enable_quantization(self, plan: QuantizationPlan, group: GroupPlan) -> None:
        """Quantize this layer's weight per `group` once the scheduler reaches the plan's offset."""
        self.quantization = plan
        start = group.target_bits if plan.in_forward else group.start_bits
        self.schedule = BitSchedule(start, group.target_bits, group.quantization_period)

    def enable_pruning(self, group: GroupPlan) -> None:
        """Fix the l1 mask now (from the weight as it is), applied once the scheduler reaches the offset."""
        self.sparse_pruning_mask = l1_mask(self.weight, group.dense_ratio)

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
        return weight

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(input, self.compressed_weight(), self.bias)

    def cleaned(self) -> nn.Linear:
        """A plain nn.Linear holding the weight forward uses now (redundancy_clean)."""
        plain = nn.Linear(
            self.in_features,
            self.out_features,
            bias=self.bias is not None,
            device=self.weight.device,
            dtype=self.weight.dtype,
        )
        with torch.no_grad():
            plain.weight.copy_(self.compressed_weight())
            if self.bias is not None:
                plain.bias.copy_(self.bias)
        return plain

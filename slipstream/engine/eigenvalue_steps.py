"""When the engine computes the block-Hessian eigenvalues of the `eigenvalue` section (profiling/eigenvalue.py),
and where they go.

As in DeepSpeed they are computed at the accumulation boundary of every `gas_boundary_resolution`-th optimizer
step (steps r, 2r, ... counted from 1), here from the loss of that boundary micro-batch, inside
`engine.backward(loss)` just before its own backward (a PyTorch-style `loss.backward()` on the engine's outputs
computes none). Every rank computes them (the same work on every rank keeps ranks in step); rank 0 writes them to
the monitors as `Train/Eigenvalues/ModelBlockParam_<block>` at the sample count after that step, the value
relative to the largest block's, as DeepSpeed writes them. A model whose graph has no second derivative (a
reentrant activation checkpoint, a custom kernel without double backward) gets one warning and no further tries.
At ZeRO stage 3 the section is reported as not implemented (the backward hooks of its gathered units would run
for the extra backward passes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn

from slipstream.config.plan import EnginePlan
from slipstream.profiling.eigenvalue import block_eigenvalues, find_blocks, relative_to_largest
from slipstream.utils.logging import get_logger, log_rank0

__all__ = ["EigenvalueSteps", "EVENT"]

EVENT = "Train/Eigenvalues/ModelBlockParam_{}"


class _Writer(Protocol):
    def write(self, events: dict[str, float], samples: int) -> None: ...


class EigenvalueSteps:
    """The engine's `eigenvalue` hook: `before_backward` at every micro-batch (does nothing when off)."""

    def __init__(self, plan: EnginePlan, module: nn.Module, monitors: Sequence[_Writer], *, rank: int) -> None:
        self.plan, self.module, self.monitors, self.rank = plan.eigenvalue, module, monitors, rank
        self.samples_per_step = plan.batch.train_batch_size
        self.values: list[float] = []
        """The eigenvalue of each block at the last computation (before the relative scaling)."""
        self.block_eigenvalue: dict[int, tuple[float, int]] = {}
        """DeepSpeed's `engine.block_eigenvalue`: parameter id -> (relative eigenvalue, block index)."""

    def before_backward(self, loss: torch.Tensor, step: int, samples: int, *, boundary: bool) -> None:
        """At the boundary micro-batch of optimizer step `step` (1-based) when it is due: compute, and report at
        the sample count after that step (`samples`: the count before it)."""
        plan = self.plan
        if plan is None or not boundary or step % plan.every_steps != 0 or not loss.requires_grad:
            return
        blocks = find_blocks(self.module, plan.layer_name, plan.layer_num)
        try:
            found = block_eigenvalues(loss, blocks, max_iter=plan.max_iter, tol=plan.tol, stability=plan.stability)
        except RuntimeError as exc:
            get_logger().warning(f"eigenvalue: the model has no second derivative here ({exc}); no eigenvalues")
            self.plan = None
            return
        self.values = [block.value for block in found]
        relative = relative_to_largest(self.values)
        self.block_eigenvalue = {
            id(p): (value, index)
            for index, (block, value) in enumerate(zip(blocks, relative))
            for p in block.parameters()
        }
        if plan.verbose:
            for index, block in enumerate(found):
                log_rank0(
                    f"eigenvalue: block {index}, {block.iterations} power iterations, {block.value}", rank=self.rank
                )
        events = {EVENT.format(index): value for index, value in enumerate(relative)}
        for monitor in self.monitors:
            monitor.write(events, samples + self.samples_per_step)

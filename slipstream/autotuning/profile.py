"""The tuner's short profile of the model, taken in the profile run (trial.py) and read by the estimate
(throughput.py).

Optimizer step 1 runs under the flops profiler's counter from the model's first forward to the step's end (FLOPs
of the forward, the loss and the backward of every micro step: the model's FLOPs per sample; what the script
computes before its first forward, its batch, is not counted). Step 2 is timed: each block's forward (a pre- and a post-hook on the block,
the device synchronised at both), the whole forward (hooks on the root module) and the whole step (from the end
of step 1 to the end of step 2). The blocks are the entries of the model's largest `ModuleList` (a transformer's
layers), else its direct children; what the root's forward spends outside them is the row "(rest)".
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from torch import nn
from torch.utils.hooks import RemovableHandle

from slipstream.accelerator import get_accelerator
from slipstream.profiling.flops_profiler import FlopsProfiler

__all__ = ["REST", "ModelProfile", "ProfileTimer", "blocks_of"]

REST = "(rest)"
"""The row of the forward's time spent outside the blocks (embeddings, the head, the loss)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ModelProfile:
    """One rank's measurements of the profiled candidate."""

    micro_batch: int
    grad_accum: int
    block_forward_s: dict[str, float]
    """Forward seconds per micro step of each block (and `REST`), at `micro_batch`."""
    step_s: float
    """Wall seconds of the whole optimizer step (every micro step's forward and backward, the optimizer)."""
    flops_per_sample: float | None
    """Forward and backward FLOPs per sample (None: nothing counted)."""
    numel: int
    """Parameters of the model (stage-3 parameters at their global shapes; the planner's count, estimates.py)."""
    param_bytes: int
    """Bytes of one parameter element as the module holds it."""

    @property
    def forward_s(self) -> float:
        return sum(self.block_forward_s.values())


def blocks_of(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The blocks timed: the entries of the largest `ModuleList` (by parameters), else the direct children."""
    lists = [(name, m) for name, m in module.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if lists:
        name, found = max(lists, key=lambda item: sum(p.numel() for p in item[1].parameters()))
        return [(f"{name}.{index}", block) for index, block in enumerate(found)]
    return list(module.named_children())


class ProfileTimer:
    """Counts step 1, times step 2 (see the module's docstring); `step_ended` says when the profile is taken."""

    def __init__(self, module: nn.Module, *, micro_batch: int, grad_accum: int) -> None:
        self.module, self.micro_batch, self.grad_accum = module, micro_batch, grad_accum
        self.counter: FlopsProfiler | None = FlopsProfiler(module)
        self.flops: float | None = None
        self.times: dict[str, float] = {}
        self.opened: dict[str, float] = {}
        self.hooks: list[RemovableHandle] = [module.register_forward_pre_hook(self._count)]
        self.step_began = 0.0
        self.result: ModelProfile | None = None

    def _count(self, module: nn.Module, inputs: object) -> None:
        """The first forward of step 1 starts the counter (once)."""
        if self.counter is not None and not self.counter.started:
            self.counter.start_profile(time_modules=False)
        self.hooks.pop().remove()

    @staticmethod
    def _now() -> float:
        get_accelerator().synchronize()
        return time.perf_counter()

    def _open(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: object) -> None:
            self.opened[name] = self._now()

        return hook

    def _close(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, inputs: object, output: object) -> None:
            self.times[name] = self.times.get(name, 0.0) + self._now() - self.opened.pop(name, self._now())

        return hook

    def _time_blocks(self) -> None:
        for name, block in [("", self.module), *blocks_of(self.module)]:
            self.hooks.append(block.register_forward_pre_hook(self._open(name)))
            self.hooks.append(block.register_forward_hook(self._close(name)))

    def step_ended(self, step: int) -> bool:
        """After optimizer step `step`: True once the profile is taken (`result`)."""
        if step == 1 and self.counter is not None:
            self.counter.stop_profile()
            total = float(self.counter.get_total_flops())
            self.flops, self.counter = (total or None), None
            self._time_blocks()
            self.step_began = self._now()
            return False
        step_s = self._now() - self.step_began
        for handle in self.hooks:
            handle.remove()
        self.result = self.profile(step_s)
        return True

    def profile(self, step_s: float) -> ModelProfile:
        steps = max(self.grad_accum, 1)
        whole = self.times.pop("", 0.0)
        blocks = {name: seconds / steps for name, seconds in self.times.items()}
        blocks[REST] = max(0.0, whole / steps - sum(blocks.values()))
        first = next(self.module.parameters(), None)
        samples = self.micro_batch * steps
        return ModelProfile(
            micro_batch=self.micro_batch,
            grad_accum=steps,
            block_forward_s=blocks,
            step_s=step_s,
            flops_per_sample=None if self.flops is None else self.flops / samples,
            numel=sum(p.numel() for p in self.module.parameters()),
            param_bytes=first.element_size() if first is not None else 4,
        )

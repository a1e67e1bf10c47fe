"""The engine's compression scheduler, as DeepSpeed's engine drives it: built when the config has a
`compression_training` section and the model went through init_compression (it holds compressed layers);
`step(step_zero_check=True)` before each forward while no optimizer step has happened yet (methods whose
schedule_offset is 0 start at once), and `step()` after each optimizer step the engine applied (a step skipped
for an fp16 overflow does not count). After load_checkpoint the first forward replays the applied steps the
checkpoint counts (global_steps - skipped_steps), so the schedules resume where they were. The engine keeps it
as `engine.compression_scheduler` (None otherwise)."""

from __future__ import annotations

from torch import nn

from slipstream.compression.compress import compression_scheduler
from slipstream.compression.layers import CompressedConv2d, CompressedLinear
from slipstream.config.plan import EnginePlan

__all__ = ["after_optimizer_step", "before_forward", "scheduler_for"]


def scheduler_for(plan: EnginePlan, module: nn.Module) -> compression_scheduler | None:
    """The scheduler of `module`'s compressed layers, or None (no section, or no compressed layer)."""
    if plan.compression_training is None:
        return None
    if not any(isinstance(m, (CompressedLinear, CompressedConv2d)) for m in module.modules()):
        return None
    return compression_scheduler(module, {"compression_training": plan.compression_training})


def before_forward(scheduler: compression_scheduler | None, global_steps: int, skipped_steps: int) -> None:
    """Step zero's check; after load_checkpoint, the steps the saved run applied, replayed (the scheduler is
    stepped once per applied step, so it is behind only in a resumed run; the masks are in the checkpoint)."""
    if scheduler is None:
        return
    if global_steps == 0 or scheduler.training_steps < global_steps - skipped_steps:
        scheduler.step(step_zero_check=True)
    while scheduler.training_steps < global_steps - skipped_steps:
        scheduler.step()


def after_optimizer_step(scheduler: compression_scheduler | None, applied: bool) -> None:
    if scheduler is not None and applied:
        scheduler.step()

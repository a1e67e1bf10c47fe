"""ZeRO stages 0-2 inside a pipeline stage: the stage's optimizer runs over its data-parallel group, plus two
things a pipeline needs (a subclass of the chosen stage, made by `pipeline_optimizer_class`):

- Tied weights (TiedLayerSpec): their gradients are taken out of ZeRO's hooks into a buffer per weight, summed
  at the step over every rank of the stages that share the weight (data-parallel replicas included, so the
  sum is also the data-parallel reduction), and each rank adds its owned part into the reduced gradients.
  Every stage's copy then gets the same update.
- The global gradient norm (clipping, `get_global_grad_norm`): the squared norm of this stage's owned
  gradients is summed over the pipeline (same data-parallel index, every stage) before ZeRO sums it over the
  data-parallel group; a tied weight counts once, at the first stage that uses it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from slipstream.comm import collectives
from slipstream.zero.optimizer import ZeroOptimizer


class _PipelineGrads:
    """Mixin over a ZeroOptimizer stage class; `attach_pipeline` must be called right after construction."""

    groups: list[Any]
    _param_location: dict[int, Any]

    def attach_pipeline(
        self,
        *,
        tied: list[tuple[torch.Tensor, dist.ProcessGroup | None, bool]],
        pipe_group: dist.ProcessGroup | None,
        pipe_size: int,
    ) -> None:
        """`tied`: (parameter, the group its gradient is summed over, whether this stage counts it in the norm)."""
        self._tied = {id(p): (p, group, counted) for p, group, counted in tied}
        self._tied_grads = {id(p): torch.zeros_like(p, dtype=torch.float32) for p, _, _ in tied}
        self._pipe_group, self._pipe_size = pipe_group, pipe_size

    def _on_grad(self, param: torch.Tensor) -> None:
        if id(param) in getattr(self, "_tied", {}):
            if param.grad is not None:
                self._tied_grads[id(param)].add_(param.grad)
                param.grad = None
            return
        super()._on_grad(param)  # type: ignore[misc]

    def take_grads(self, params: list[torch.Tensor]) -> None:
        """Feed gradients that were set without autograd's accumulation hooks (the zero-bubble weight pass)."""
        for param in params:
            if param.grad is not None and (id(param) in self._param_location or id(param) in self._tied):
                self._on_grad(param)

    def _owned_parts(self, param: torch.Tensor) -> list[tuple[torch.Tensor, slice]]:
        """(owned gradient view, the matching slice of the flattened parameter) for this rank's part."""
        flat, index = self._param_location[id(param)]
        slot = flat.layout.slots[index]
        out = []
        for (start, _end), grad in zip(flat.piece_ranges, flat.owned_grads):
            lo = max(slot.flat_offset, start)
            hi = min(slot.flat_offset + slot.numel, start + grad.numel())
            if hi > lo:
                out.append((grad[lo - start : hi - start], slice(lo - slot.flat_offset, hi - slot.flat_offset)))
        return out

    def _reduce_for_step(self) -> None:
        super()._reduce_for_step()  # type: ignore[misc]
        for key, (param, group, _) in self._tied.items():  # in tied-key order on every rank (module.py)
            total = self._tied_grads[key]
            collectives.all_reduce(total, group=group)
            flat_total = total.reshape(-1)
            for grad, cut in self._owned_parts(param):
                grad.add_(flat_total[cut].to(grad.dtype))
            total.zero_()

    def _local_grad_stats(self, owned: list[torch.Tensor]) -> torch.Tensor:
        stats: torch.Tensor = super()._local_grad_stats(owned)  # type: ignore[misc]
        for param, _group, counted in self._tied.values():
            if counted:
                continue
            for grad, _cut in self._owned_parts(param):
                stats[0] -= torch.linalg.vector_norm(grad, dtype=torch.float32).double().pow(2)
        if self._pipe_size > 1:
            collectives.all_reduce(stats, group=self._pipe_group)
        return stats


_CLASSES: dict[type, type] = {}


def pipeline_optimizer_class(stage_class: type[ZeroOptimizer]) -> type[ZeroOptimizer]:
    """`stage_class` with the pipeline's tied-weight and norm handling."""
    if stage_class not in _CLASSES:
        _CLASSES[stage_class] = type(f"Pipeline{stage_class.__name__}", (_PipelineGrads, stage_class), {})
    return _CLASSES[stage_class]

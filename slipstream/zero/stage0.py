"""ZeRO stage 0: replicated parameters, gradients and optimizer state; gradients all-reduced in buckets (in the
reduce dtype, zero/staging.py `StepReducer`).

[Note: optimizers that communicate themselves]
An optimizer may take over the gradient all-reduce (the 1-bit optimizers do once their warm-up is over, as
DeepSpeed's turn off its backward all-reduce). Before each step stage 0 calls the wrapped optimizer's
`takes_over_reduction(group) -> bool`, when it has one. On True this step's gradients are not all-reduced: each
rank's optimizer gets its own gradients, divided by the accumulation steps and the loss scale but not by the
world size, and the gradient norm (and clipping) is this rank's. Under fp16 and bf16 the ranks still agree on an
overflow (one all-reduce of the non-finite count), so that they skip the same steps. The ZeRO stages that shard
refuse such optimizers (zero/build.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from slipstream.comm import collectives
from slipstream.zero.sparse_rows import SparseRows, dense_parts, reduce_sparse_rows
from slipstream.zero.staging import ReducesAtStep, bucket_dtype


def reduces_itself(optimizer: torch.optim.Optimizer, group: dist.ProcessGroup | None) -> bool:
    """The optimizer's answer to `takes_over_reduction(group)`, False when it has no such method."""
    ask = getattr(optimizer, "takes_over_reduction", None)
    return bool(ask(group)) if callable(ask) else False


class Stage0Optimizer(ReducesAtStep):
    """Data parallelism as DDP does it, on the flat layout: every rank owns every bucket."""

    owns_all = True
    full_grad_storage = True
    _local_grads = False
    """This step's gradients stay on their rank (see [Note: optimizers that communicate themselves])."""
    sparse_rows: SparseRows | None = None
    """sparse_gradients: the embedding tables reduced as rows (zero/sparse_rows.py [Note: sparse rows])."""

    def _reduce_for_step(self) -> None:
        self._local_grads = reduces_itself(self.optimizer, self.process_group)
        if self._local_grads:
            return
        for flat in self.groups:
            if flat.world_size == 1:
                continue
            for bucket in flat.layout.buckets:
                dtype = bucket_dtype(self.zero, bucket)
                for part in dense_parts(self.sparse_rows, flat, bucket):
                    self.step_reducer.all_reduce(part, group=flat.process_group, dtype=dtype)
                reduce_sparse_rows(self.sparse_rows, flat, bucket, dtype)
        self.step_reducer.finish_all()

    def _grad_stats(self, grad_divisor: float) -> torch.Tensor:
        if not self._local_grads:
            return super()._grad_stats(grad_divisor)
        stats = super()._grad_stats(grad_divisor / self.world_size)
        if self.check_overflow and self.world_size > 1:
            nonfinite = stats[1:].clone()
            collectives.all_reduce(nonfinite, group=self.process_group)
            stats[1] = nonfinite[0]
        return stats

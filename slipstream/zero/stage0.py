"""ZeRO stage 0: replicated parameters, gradients and optimizer state; gradients all-reduced in buckets."""

from __future__ import annotations

from slipstream.comm import collectives
from slipstream.zero.optimizer import ZeroOptimizer


class Stage0Optimizer(ZeroOptimizer):
    """Data parallelism as DDP does it, on the flat layout: every rank owns every bucket."""

    owns_all = True
    full_grad_storage = True

    def _reduce_for_step(self) -> None:
        works = [
            collectives.all_reduce(flat.bucket_grads(bucket), group=flat.process_group, async_op=True)
            for flat in self.groups
            if flat.world_size > 1
            for bucket in flat.layout.buckets
        ]
        for work in works:
            work.wait()

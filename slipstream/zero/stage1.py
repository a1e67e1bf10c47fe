"""ZeRO stage 1: optimizer state and fp32 master weights sharded; gradients reduce-scattered at the boundary.

Gradients accumulate locally in full-size storage over the micro-batches of one optimizer step; at the
boundary each bucket is reduce-scattered in place, so a rank's piece of the storage holds the summed
gradient of the piece it owns.
"""

from __future__ import annotations

from slipstream.comm import collectives
from slipstream.zero.optimizer import ZeroOptimizer


class Stage1Optimizer(ZeroOptimizer):
    owns_all = False
    full_grad_storage = True

    def _reduce_for_step(self) -> None:
        works = []
        for flat in self.groups:
            if flat.world_size == 1:
                continue
            for bucket, (start, end) in zip(flat.layout.buckets, flat.piece_ranges):
                works.append(
                    collectives.reduce_scatter(
                        flat.grad_storage[start:end], flat.bucket_grads(bucket), group=flat.process_group, async_op=True
                    )
                )
        for work in works:
            work.wait()

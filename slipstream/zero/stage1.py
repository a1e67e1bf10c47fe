"""ZeRO stage 1: optimizer state and fp32 master weights sharded; gradients reduce-scattered at the boundary.

Gradients accumulate locally in full-size storage over the micro-batches of one optimizer step; each bucket is
reduce-scattered once per step (in the reduce dtype, zero/staging.py `StepReducer`), so a rank's piece of the
storage holds the summed gradient of the piece it owns.

[Note: stage-1 overlapped reduction]
Without overlap_comm every bucket is reduced at the step. With it, a backward pass (from its first gradient
to the engine's `micro_step_done`) that starts at the accumulation boundary (`at_boundary()`, which the engine
sets: the boundary, outside no_sync) launches each bucket's reduce-scatter as soon as every parameter in it has
its gradient from that pass and every earlier bucket has been launched: strictly in layout order, on every
rank, so ranks issue the same collectives in the same order whatever their control flow; the step launches
the rest (buckets with parameters that got no gradient) and waits for all of them. A launched bucket's
storage is being reduced in place, so a gradient for it before the step (a second backward of the last
micro-batch) is an error naming the parameter, as DeepSpeed's stage 1 with overlap_comm refuses it too.

[Note: 1-bit gradients at stage 1]
An optimizer that takes over the reduction ([Note: optimizers that communicate themselves], stage0.py) and
has `attach_gradient_buckets` (1-bit Adam) runs here too. At build it is told each bucket's name and size. On a
step where `takes_over_reduction` says True, no bucket is reduce-scattered (nor launched during backward): each
bucket's local gradient goes through the optimizer's `compressed_mean(name, bucket)` (its error buffers, one pair
per bucket, are the optimizer's and travel in its checkpoints), and the owned pieces are multiplied by the world
size, so they hold what the reduce-scatter would have left: the sum over the ranks of the gradients as
accumulated. Each rank's optimizer then steps its shard. When the overflow check is on, the ranks first agree on whether any local
gradient is non-finite (one all-reduce of a count); if one is, nothing is compressed (the errors stay clean) and
the step is reported as an overflow on every rank.
"""

from __future__ import annotations

import collections

import torch

from slipstream.comm import collectives
from slipstream.zero.comm_stream import CommStream
from slipstream.zero.flat_group import FlatGroup
from slipstream.zero.layout import Bucket
from slipstream.zero.span_step import SpanStep
from slipstream.zero.stage0 import reduces_itself
from slipstream.zero.staging import ReducesAtStep, bucket_dtype


class Stage1Optimizer(ReducesAtStep):
    owns_all = False
    full_grad_storage = True

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self._order = [
            (flat, b) for flat in self.groups if flat.world_size > 1 for b in range(len(flat.layout.buckets))
        ]
        self._position = {(id(flat), b): i for i, (flat, b) in enumerate(self._order)}
        self._arrived: dict[tuple[int, int], set[int]] = collections.defaultdict(set)
        self._next = 0
        self._pass_open = False
        """A backward pass has produced gradients since the last `micro_step_done`."""
        self._early = False
        """This pass reduces buckets as they fill ([Note: stage-1 overlapped reduction])."""
        self.peak_in_flight = 0
        """The most reductions launched during backward still in flight when the step began."""
        self.span_step = SpanStep.for_optimizer(self, comm=CommStream(enabled=self.zero.overlap_comm))
        self._one_bit = callable(getattr(self.optimizer, "attach_gradient_buckets", None))
        self._dropped = False
        """This step's local gradients were not finite anywhere: it is an overflow ([Note: 1-bit gradients ...])."""
        if self._one_bit:
            if self._other_groups():
                raise ValueError(
                    f"{type(self.optimizer).__name__} at ZeRO stage 1 compresses gradients over one process group, "
                    "but some param groups are reduced over others (MoE experts); use ZeRO stage 0"
                )
            self.optimizer.attach_gradient_buckets(  # type: ignore[attr-defined]
                {name: bucket.padded_numel for name, _, bucket in self._named_buckets()}
            )

    def micro_step_done(self, *, reduce: bool) -> None:
        super().micro_step_done(reduce=reduce)
        self._pass_open = False

    def _accumulate(self, flat: FlatGroup, index: int, grad: object) -> None:
        key = (id(flat), flat.layout.slots[index].bucket)
        position = self._position.get(key)
        if position is not None and position < self._next:
            name = self.param_names.get(id(flat.params[index]), f"<param {index}>")
            raise RuntimeError(
                f"ZeRO stage 1 with overlap_comm: a second gradient for '{name}' arrived after its bucket was "
                "already reduce-scattered in the last backward before the step; run one backward per micro-batch "
                "(add the losses first), or set zero_optimization.overlap_comm to false"
            )
        super()._accumulate(flat, index, grad)  # type: ignore[arg-type]
        if not self._pass_open:
            self._pass_open = True
            self._early = self.zero.overlap_comm and self.at_boundary() and not self._compresses()
            self._arrived.clear()
        if not self._early or position is None:
            return
        self._arrived[key].add(index)
        while self._next < len(self._order):
            next_flat, bucket = self._order[self._next]
            if len(self._arrived[(id(next_flat), bucket)]) < len(next_flat.layout.buckets[bucket].param_indices):
                break
            self._launch(next_flat, bucket)

    def _launch(self, flat: FlatGroup, bucket_id: int) -> None:
        start, end = flat.piece_ranges[bucket_id]
        bucket = flat.layout.buckets[bucket_id]
        self.step_reducer.reduce_scatter(
            flat.grad_storage[start:end],
            flat.bucket_grads(bucket),
            group=flat.process_group,
            dtype=bucket_dtype(self.zero, bucket),
        )
        self._next += 1

    def zero_grad(self) -> None:
        self.step_reducer.finish_all()  # a reduction launched during backward completes before its storage is cleared
        self._next, self._early, self._pass_open = 0, False, False
        self._arrived.clear()
        super().zero_grad()

    def _named_buckets(self) -> list[tuple[str, FlatGroup, Bucket]]:
        return [
            (f"zero1.{g}.{b}", flat, bucket)
            for g, flat in enumerate(self.groups)
            if flat.world_size > 1
            for b, bucket in enumerate(flat.layout.buckets)
        ]

    def _compresses(self) -> bool:
        return self._one_bit and reduces_itself(self.optimizer, self.process_group)

    def _compress_for_step(self) -> None:
        """See [Note: 1-bit gradients at stage 1]."""
        if self.check_overflow and self.world_size > 1:
            bad = torch.stack([(~torch.isfinite(flat.grad_storage)).sum() for flat in self.groups]).sum().double()
            collectives.all_reduce(bad, group=self.process_group)
            self._dropped = bool(bad > 0)
            if self._dropped:
                return
        for name, flat, bucket in self._named_buckets():
            self.optimizer.compressed_mean(name, flat.bucket_grads(bucket))  # type: ignore[attr-defined]
        for flat in self.groups:
            for grad in flat.owned_grads if flat.world_size > 1 else ():
                grad.mul_(flat.world_size)

    def _grad_stats(self, grad_divisor: float) -> torch.Tensor:
        stats = super()._grad_stats(grad_divisor)
        if self._dropped:
            stats[1] += 1
            self._dropped = False
        return stats

    def _reduce_for_step(self) -> None:
        self.peak_in_flight = max(self.peak_in_flight, self.step_reducer.in_flight)
        if self._compresses():
            self._compress_for_step()
            self._next, self._early, self._pass_open = 0, False, False
            self._arrived.clear()
            return
        while self._next < len(self._order):
            self._launch(*self._order[self._next])
        self.step_reducer.finish_all()
        self._next, self._early, self._pass_open = 0, False, False
        self._arrived.clear()

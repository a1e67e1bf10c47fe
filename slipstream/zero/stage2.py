"""ZeRO stage 2: gradients sharded too; buckets are reduce-scattered during backward, as they fill.

[Note: stage-2 bucket schedule]
- Buckets are launched strictly in layout order (reverse registration order, roughly the order backward
  produces gradients), on every rank. A bucket launches as soon as all of its parameters have
  gradients and every earlier bucket has launched; `micro_step_done()` (the engine calls it after each
  micro-batch's backward) launches the rest, with zeros for parameters that got no gradient on this
  rank. So every rank issues the same collectives in the same order, whatever its control flow took:
  unused parameters and conditional branches never hang.
- Buckets hold at most `STAGE2_STAGING_BYTES` of gradients whatever `reduce_bucket_size` says, and a
  larger parameter is reduced in chunks of that size ([Note: stage-2 staging bound] in layout.py).
- Launching packs the bucket's gradients into a staging buffer of the `StagingRing` (zero/staging.py), cast
  to the bucket's reduce dtype (communication_data_type, or the autocast dtype for torch_autocast's safe
  modules: [Note: buckets by reduce dtype] in layout.py), and starts an asynchronous reduce-scatter into its receive
  buffer; the freshly produced `param.grad` tensors are dropped as they are packed. Reusing a slot waits for
  the reduce-scatter that used it last and adds its result into this rank's shard of the gradients. With
  overlap_comm off each reduce-scatter is waited for and added at launch ([Note: overlapped gradient
  reduction] in staging.py).
- A gradient for a bucket already launched (or a second one for a parameter still pending) means a new
  backward began before `micro_step_done()` closed the last one: Accelerate and Transformers accumulate
  this way (`set_gradient_accumulation_boundary(False)`, several `backward()` calls, `step()` only at the
  boundary), and a second backward of one micro-batch looks the same. The previous pass is completed first
  (its remaining buckets launched, in order, with zeros for gradients it did not produce), then counting
  starts again. Reduced shards add up, so the sum over passes is the sum of the gradients; every rank that
  runs the same number of backward passes issues the same collectives.
"""

from __future__ import annotations

import collections

import torch

from slipstream.comm import collectives
from slipstream.zero.flat_group import FlatGroup
from slipstream.zero.layout import Bucket, stage2_bucket_numel, stage2_chunk_numel
from slipstream.zero.optimizer import DTYPES, ZeroOptimizer
from slipstream.zero.span_step import SpanStep
from slipstream.zero.staging import StagingRing, bounded_sizes, bucket_dtype


class Stage2Optimizer(ZeroOptimizer):
    owns_all = False
    full_grad_storage = False

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._order: list[tuple[FlatGroup, int]] = [
            (flat, b) for flat in self.groups for b in range(len(flat.layout.buckets))
        ]
        self._position = {(id(flat), b): i for i, (flat, b) in enumerate(self._order)}
        self._chunk = {id(f): stage2_chunk_numel(f.layout, f.grad_storage.element_size()) for f in self.groups}
        device = self.groups[0].device if self.groups else None
        sizes = bounded_sizes(self.zero, self.groups, self.world_size)
        default = sizes.pop(DTYPES[self.zero.reduce_dtype], (0, 0))
        self._ring = StagingRing.for_plan(
            self.zero, staging_numel=default[0], receive_numel=default[1], device=device, more=sizes
        )
        self._pending: dict[tuple[int, int], dict[int, torch.Tensor]] = collections.defaultdict(dict)
        self._next = 0
        self.span_step = SpanStep.for_optimizer(self, comm=self._ring.comm)  # the gathers share the ring's stream

    def _layout_bucket_numel(self, reduce_bucket_size: int, grad_dtype: torch.dtype) -> int:
        return stage2_bucket_numel(reduce_bucket_size, torch.empty((), dtype=grad_dtype).element_size())

    def _accumulate(self, flat: FlatGroup, index: int, grad: torch.Tensor) -> None:
        self._settled = False  # a new backward: the accessors flush again before they read
        bucket_id = flat.layout.slots[index].bucket
        position = self._position[(id(flat), bucket_id)]
        if position < self._next or index in self._pending[(id(flat), bucket_id)]:
            self._start_new_pass()  # see [Note: stage-2 bucket schedule]
        self._pending[(id(flat), bucket_id)][index] = grad
        while self._next < len(self._order):
            next_flat, next_bucket = self._order[self._next]
            bucket = next_flat.layout.buckets[next_bucket]
            if len(self._pending[(id(next_flat), next_bucket)]) < len(bucket.param_indices):
                break
            self._launch(next_flat, next_bucket)

    def _start_new_pass(self) -> None:
        """Launch what the previous backward pass left pending, in layout order, and count from the start."""
        while self._next < len(self._order):
            self._launch(*self._order[self._next])
        self._next = 0

    def _launch(self, flat: FlatGroup, bucket_id: int) -> None:
        """Reduce-scatter one bucket, in chunks of at most `self._chunk` elements per rank (one chunk unless
        the bucket is a single parameter larger than the staging bound, [Note: stage-2 staging bound])."""
        bucket: Bucket = flat.layout.buckets[bucket_id]
        grads = self._pending.pop((id(flat), bucket_id), {})
        piece, chunk, owned = bucket.piece_numel, self._chunk[id(flat)], flat.owned_grads[bucket_id]
        world = flat.world_size  # a param group may be reduced over its own group (MoE experts)
        if world == 1:  # nothing to reduce with (MoE experts on an expert-data-parallel group of one rank)
            self._add_own(flat, bucket, grads, owned)
            self._next += 1
            return
        for lo in range(0, piece, chunk):
            n = min(chunk, piece - lo)
            slot, staging, receive = self._ring.take(n * world, n, bucket_dtype(self.zero, bucket))
            for rank in range(world):
                self._pack(flat, bucket, grads, staging[rank * n : (rank + 1) * n], rank * piece + lo)
            with self._ring.launching():
                work = collectives.reduce_scatter(
                    receive, staging, group=flat.process_group, async_op=True, input_is_scratch=True
                )
            self._ring.launched(slot, work, receive, owned[lo : lo + n].add_)
        self._next += 1

    @staticmethod
    def _add_own(flat: FlatGroup, bucket: Bucket, grads: dict[int, torch.Tensor], owned: torch.Tensor) -> None:
        """A group of one rank owns its whole bucket: add the gradients into it directly (no staging copy)."""
        for index, grad in grads.items():
            slot = flat.layout.slots[index]
            lo = slot.flat_offset - bucket.flat_offset
            owned[lo : lo + slot.numel].add_(grad.reshape(-1))

    @staticmethod
    def _pack(flat: FlatGroup, bucket: Bucket, grads: dict[int, torch.Tensor], out: torch.Tensor, start: int) -> None:
        """`out` := the bucket's gradients at bucket positions [start, start + len(out)); zeros where a
        parameter got no gradient and in the padding."""
        end, filled = start + out.numel(), start
        for index in bucket.param_indices:
            slot = flat.layout.slots[index]
            lo = slot.flat_offset - bucket.flat_offset
            a, z = max(lo, start), min(lo + slot.numel, end)
            if z <= a:
                continue
            grad = grads.get(index)
            if grad is None:
                continue
            if a > filled:
                out[filled - start : a - start].zero_()
            out[a - start : z - start].copy_(grad.reshape(-1)[a - lo : z - lo])
            filled = z
        if filled < end:
            out[filled - start :].zero_()

    def micro_step_done(self, *, reduce: bool) -> None:
        if not reduce:
            raise RuntimeError(
                "ZeRO stage 2 reduces gradients during every backward; no_sync() is not "
                "available (use stage 0 or 1 for no_sync, or rely on gradient_accumulation_steps)"
            )
        while self._next < len(self._order):
            self._launch(*self._order[self._next])
        self._ring.finish_all()
        self._next = 0
        self._pending.clear()

    def _reduce_for_step(self) -> None:
        self._ring.finish_all()  # normally already finished by micro_step_done()

    def _comm_buffer_bytes(self) -> int:
        return self._ring.nbytes

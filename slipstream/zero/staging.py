"""The reusable buffers of gradient reductions: `StagingRing` (reductions launched during backward, stages 2 and 3,
and stages 0-1 when gradients travel in another dtype than they are stored in) and `StepReducer` (stages 0-1).

Two staging buffers (the packed gradients, rank-major) and two receive buffers (this rank's summed piece) are
allocated once, for the largest reduction, in the dtype gradients travel in, and used in turn. Taking a slot
first completes the reduction that used it last: it waits for the collective and hands the received piece to
that reduction's `deliver` (which adds it into the owned gradient storage, in that storage's dtype). So at most
two reductions are in flight, and buffers are never re-allocated.

[Note: overlapped gradient reduction]
With `overlap` (zero_optimization.overlap_comm) a launched reduction stays in flight while backward goes on: it
is waited for only when its slot is taken again (two reductions later) or at `finish_all` (the end of the
micro-batch or the step). The wait goes through the timed collective (comm/collectives.py), so the deadline is
measured from the launch and a rank that never arrives is named as for a blocking collective. On a GPU the
backend runs the collective on its own stream and `wait()` orders the current stream after it. Without
`overlap` each reduction is waited for and delivered at launch. Both deliver the same sums into the same
storage in the same order, so the results are bit-identical; `peak_in_flight` shows which of the two ran.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from slipstream.comm import collectives
from slipstream.comm.collectives import TimedWork
from slipstream.config.plan import ZeroPlan
from slipstream.zero.optimizer import DTYPES, ZeroOptimizer

_NUM_SLOTS = 2


class StagingRing:
    def __init__(
        self,
        *,
        staging_numel: int,
        receive_numel: int,
        dtype: torch.dtype,
        device: torch.device | None,
        overlap: bool = True,
    ) -> None:
        self.staging = [torch.zeros(staging_numel, dtype=dtype, device=device) for _ in range(_NUM_SLOTS)]
        self.receive = [torch.zeros(receive_numel, dtype=dtype, device=device) for _ in range(_NUM_SLOTS)]
        self.overlap = overlap
        self._in_flight: dict[int, tuple[TimedWork | None, torch.Tensor, Callable[[torch.Tensor], object]]] = {}
        self._turn = 0
        self.peak_in_flight = 0
        """The most reductions in flight at once so far (0 when every one was waited for at launch)."""

    @classmethod
    def for_plan(
        cls, zero: ZeroPlan, *, staging_numel: int, receive_numel: int, device: torch.device | None
    ) -> StagingRing:
        """The ring of the reductions launched during backward (stages 2 and 3): buffers in the dtype gradients
        travel in (communication_data_type), overlapped as zero_optimization.overlap_comm says."""
        return cls(
            staging_numel=staging_numel,
            receive_numel=receive_numel,
            dtype=DTYPES[zero.reduce_dtype],
            device=device,
            overlap=zero.overlap_comm,
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.staging[0].dtype

    def take(self, staging_numel: int, receive_numel: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        """The next slot (its previous reduction completed) and its staging and receive views."""
        slot = self._turn % _NUM_SLOTS
        self._turn += 1
        self._finish(slot)
        return slot, self.staging[slot][:staging_numel], self.receive[slot][:receive_numel]

    def launched(
        self, slot: int, work: TimedWork | None, receive: torch.Tensor, deliver: Callable[[torch.Tensor], object]
    ) -> None:
        """`work` (None when already complete) fills `receive`; `deliver(receive)` runs once it has: at once
        without overlap, else when the slot is needed again. See [Note: overlapped gradient reduction]."""
        self._in_flight[slot] = (work, receive, deliver)
        if not self.overlap:
            self._finish(slot)
            return
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)

    def _finish(self, slot: int) -> None:
        entry = self._in_flight.pop(slot, None)
        if entry is None:
            return
        work, receive, deliver = entry
        if work is not None:
            work.wait()
        deliver(receive)

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def finish_all(self) -> None:
        for slot in list(self._in_flight):
            self._finish(slot)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.staging, *self.receive])


class StepReducer:
    """The reductions of stages 0 and 1, at the step, of whole buckets of the full-size gradient storage: in
    place when gradients travel in the dtype they are stored in (no extra buffer), else cast into a staging
    buffer of the reduce dtype, reduced there, and copied back (a `StagingRing` sized by the largest bucket)."""

    def __init__(
        self,
        *,
        reduce_dtype: torch.dtype,
        storage_dtype: torch.dtype,
        largest_bucket: int,
        largest_piece: int,
        device: torch.device | None,
    ) -> None:
        self._works: list[TimedWork] = []
        self.ring = None
        if reduce_dtype != storage_dtype:
            self.ring = StagingRing(
                staging_numel=largest_bucket, receive_numel=largest_piece, dtype=reduce_dtype, device=device
            )

    def reduce_scatter(self, piece: torch.Tensor, bucket: torch.Tensor, *, group: dist.ProcessGroup | None) -> None:
        """Launch: `piece` := this rank's piece of the sum of `bucket` over `group`."""
        if self.ring is None:
            self._works.append(collectives.reduce_scatter(piece, bucket, group=group, async_op=True))
            return
        slot, staging, receive = self.ring.take(bucket.numel(), piece.numel())
        staging.copy_(bucket)
        work = collectives.reduce_scatter(receive, staging, group=group, async_op=True, input_is_scratch=True)
        self.ring.launched(slot, work, receive, piece.copy_)

    def all_reduce(self, bucket: torch.Tensor, *, group: dist.ProcessGroup | None) -> None:
        """Launch: `bucket` := its sum over `group`."""
        if self.ring is None:
            self._works.append(collectives.all_reduce(bucket, group=group, async_op=True))
            return
        slot, staging, _ = self.ring.take(bucket.numel(), 0)
        staging.copy_(bucket)
        work = collectives.all_reduce(staging, group=group, async_op=True)
        self.ring.launched(slot, work, staging, bucket.copy_)

    @property
    def in_flight(self) -> int:
        """Reductions launched and not yet waited for."""
        return len(self._works) + (0 if self.ring is None else self.ring.in_flight)

    def finish_all(self) -> None:
        for work in self._works:
            work.wait()
        self._works.clear()
        if self.ring is not None:
            self.ring.finish_all()

    @property
    def nbytes(self) -> int:
        return 0 if self.ring is None else self.ring.nbytes


class ReducesAtStep(ZeroOptimizer):
    """Stages 0 and 1: gradients accumulate in full-size storage and are reduced at the step, through one
    `StepReducer` built with the flat groups."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        reduced = [flat for flat in self.groups if flat.world_size > 1]
        buckets = [bucket for flat in reduced for bucket in flat.layout.buckets]
        self.step_reducer = StepReducer(
            reduce_dtype=DTYPES[self.zero.reduce_dtype],
            storage_dtype=reduced[0].grad_storage.dtype if reduced else DTYPES[self.zero.reduce_dtype],
            largest_bucket=max((bucket.padded_numel for bucket in buckets), default=0),
            largest_piece=max((bucket.piece_numel for bucket in buckets), default=0),
            device=reduced[0].device if reduced else None,
        )

    def _comm_buffer_bytes(self) -> int:
        return self.step_reducer.nbytes

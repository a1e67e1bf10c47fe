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
measured from the launch and a rank that never arrives is named as for a blocking collective. On a device with
streams the launch is queued on the engine's communication stream (`launching`, [Note: the communication
stream] in comm_stream.py) and the current stream waits for it before the slot's receive buffer is delivered or
its staging buffer refilled. Without
`overlap` each reduction is waited for and delivered at launch. Both deliver the same sums into the same
storage in the same order, so the results are bit-identical; `peak_in_flight` shows which of the two ran.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

from slipstream.comm import collectives
from slipstream.comm.collectives import TimedWork
from slipstream.config.plan import ZeroPlan
from slipstream.zero.comm_stream import CommStream
from slipstream.zero.flat_group import FlatGroup
from slipstream.zero.layout import Bucket, bounded_pieces
from slipstream.zero.optimizer import DTYPES, ZeroOptimizer

_NUM_SLOTS = 2


class StagingRing:
    """Two slots, each with a staging and a receive buffer per dtype gradients travel in (`sizes`: dtype ->
    (staging elements, receive elements)); the first dtype is the default. One turn counter serves every dtype:
    taking a slot completes the reduction that used that slot last, whatever its dtype, so all of that slot's
    buffers are free ([Note: buckets by reduce dtype] in layout.py: torch_autocast reduces in two dtypes)."""

    def __init__(
        self,
        sizes: Mapping[torch.dtype, tuple[int, int]],
        *,
        device: torch.device | None,
        overlap: bool = True,
        comm: CommStream | None = None,
    ) -> None:
        self._buffers = {
            dtype: [
                (torch.zeros(staging, dtype=dtype, device=device), torch.zeros(receive, dtype=dtype, device=device))
                for _ in range(_NUM_SLOTS)
            ]
            for dtype, (staging, receive) in sizes.items()
        }
        self._default = next(iter(sizes))
        self.staging = [pair[0] for pairs in self._buffers.values() for pair in pairs]
        self.receive = [pair[1] for pairs in self._buffers.values() for pair in pairs]
        self.overlap = overlap
        self.comm = comm if comm is not None else CommStream(enabled=False)
        self._in_flight: dict[int, tuple[TimedWork | None, torch.Tensor, Callable[[torch.Tensor], object]]] = {}
        self._turn = 0
        self.peak_in_flight = 0
        """The most reductions in flight at once so far (0 when every one was waited for at launch)."""

    @classmethod
    def for_plan(
        cls,
        zero: ZeroPlan,
        *,
        staging_numel: int,
        receive_numel: int,
        device: torch.device | None,
        more: Mapping[torch.dtype, tuple[int, int]] | None = None,
    ) -> StagingRing:
        """The ring of the reductions launched during backward (stages 2 and 3): buffers in the dtype gradients
        travel in (communication_data_type), and in each dtype of `more` (torch_autocast's safe modules),
        overlapped as zero_optimization.overlap_comm says."""
        sizes = {DTYPES[zero.reduce_dtype]: (staging_numel, receive_numel), **(more or {})}
        comm = CommStream(enabled=zero.overlap_comm)
        return cls(sizes, device=device, overlap=zero.overlap_comm, comm=comm)

    @property
    def dtype(self) -> torch.dtype:
        return self._default

    def take(
        self, staging_numel: int, receive_numel: int, dtype: torch.dtype | None = None
    ) -> tuple[int, torch.Tensor, torch.Tensor]:
        """The next slot (its previous reduction completed) and its staging and receive views in `dtype` (None:
        the default)."""
        slot = self._turn % _NUM_SLOTS
        self._turn += 1
        self._finish(slot)
        staging, receive = self._buffers[self._default if dtype is None else dtype][slot]
        return slot, staging[:staging_numel], receive[:receive_numel]

    def launching(self, keep: Iterable[torch.Tensor] = ()) -> contextlib.AbstractContextManager[None]:
        """Around a reduction's launch: on the communication stream where there is one (`CommStream.launching`)."""
        return self.comm.launching(keep)

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
        self.comm.join()
        if work is not None:
            work.wait()
        deliver(receive)

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def finish_all(self) -> None:
        for slot in list(self._in_flight):
            self._finish(slot)

    def capacity(self, dtype: torch.dtype) -> tuple[int, int]:
        """(staging, receive) elements of one slot in `dtype`."""
        staging, receive = self._buffers[dtype][0]
        return staging.numel(), receive.numel()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.staging, *self.receive])


def bucket_dtype(zero: ZeroPlan, bucket: Bucket) -> torch.dtype:
    """The dtype `bucket`'s gradients travel in: its own (torch_autocast's safe modules), else the plan's."""
    return DTYPES[bucket.reduce_dtype or zero.reduce_dtype]


def bounded_sizes(zero: ZeroPlan, flats: Sequence[FlatGroup], world: int) -> dict[torch.dtype, tuple[int, int]]:
    """dtype -> (staging, receive) elements of a ring whose reductions of `flats`' buckets go in chunks within
    the staging bound ([Note: stage-2 staging bound] in layout.py): `world` x n and n, where n is the largest
    piece reduced in that dtype, capped at the largest chunk of the layouts (`stage2_chunk_numel`)."""
    if not flats:
        return {}
    layouts = [flat.layout for flat in flats]
    pieces = bounded_pieces(layouts, zero.reduce_dtype, flats[0].grad_storage.element_size())
    return {DTYPES[name]: (n * world, n) for name, n in pieces.items()}


class StepReducer:
    """The reductions of stages 0 and 1, at the step, of whole buckets of the full-size gradient storage: in
    place when a bucket travels in the dtype gradients are stored in (no extra buffer, the storage itself is
    summed: only the owned pieces are read afterwards), else cast into a staging buffer of its reduce dtype in
    chunks, reduced there, and copied back (a `StagingRing` with `sizes` as `bounded_sizes` gives them, so its
    buffers stay within the staging bound whatever `reduce_bucket_size` is)."""

    def __init__(
        self,
        *,
        storage_dtype: torch.dtype,
        sizes: Mapping[torch.dtype, tuple[int, int]],
        device: torch.device | None,
    ) -> None:
        self._works: list[TimedWork] = []
        self.storage_dtype = storage_dtype
        cast = {dtype: size for dtype, size in sizes.items() if dtype != storage_dtype}
        self.ring = StagingRing(cast, device=device) if cast else None

    def _staged(self, dtype: torch.dtype) -> StagingRing | None:
        return None if dtype == self.storage_dtype else self.ring

    def reduce_scatter(
        self, piece: torch.Tensor, bucket: torch.Tensor, *, group: dist.ProcessGroup | None, dtype: torch.dtype
    ) -> None:
        """Launch: `piece` := this rank's piece of the sum of `bucket` over `group`, summed in `dtype`."""
        ring = self._staged(dtype)
        if ring is None:
            self._works.append(
                collectives.reduce_scatter(piece, bucket, group=group, async_op=True, input_is_scratch=True)
            )
            return
        world = bucket.numel() // piece.numel()
        staging_numel, receive_numel = ring.capacity(dtype)
        most = min(receive_numel, staging_numel // world)
        rows = bucket.view(world, piece.numel())
        for lo in range(0, piece.numel(), most):
            n = min(most, piece.numel() - lo)
            slot, staging, receive = ring.take(world * n, n, dtype)
            staging.view(world, n).copy_(rows[:, lo : lo + n])
            work = collectives.reduce_scatter(receive, staging, group=group, async_op=True, input_is_scratch=True)
            ring.launched(slot, work, receive, piece[lo : lo + n].copy_)

    def all_reduce(self, bucket: torch.Tensor, *, group: dist.ProcessGroup | None, dtype: torch.dtype) -> None:
        """Launch: `bucket` := its sum over `group`, summed in `dtype`."""
        ring = self._staged(dtype)
        if ring is None:
            self._works.append(collectives.all_reduce(bucket, group=group, async_op=True))
            return
        most = ring.capacity(dtype)[0]
        for lo in range(0, bucket.numel(), most):
            part = bucket[lo : lo + most]
            slot, staging, _ = ring.take(part.numel(), 0, dtype)
            staging.copy_(part)
            work = collectives.all_reduce(staging, group=group, async_op=True)
            ring.launched(slot, work, staging, part.copy_)

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
        self.step_reducer = StepReducer(
            storage_dtype=reduced[0].grad_storage.dtype if reduced else DTYPES[self.zero.reduce_dtype],
            sizes=bounded_sizes(self.zero, reduced, self.world_size),
            device=reduced[0].device if reduced else None,
        )

    def _comm_buffer_bytes(self) -> int:
        return self.step_reducer.nbytes

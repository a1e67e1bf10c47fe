"""The communication stream of overlapped collectives (zero_optimization.overlap_comm): gradient reductions,
stage 3's parameter all-gathers and the gathers of stages 1-2's updated pieces.

[Note: the communication stream]
On a device with streams (CUDA) an engine with `overlap_comm` makes one stream of its own, once, and launches
each bucket's reduction on it: the stream first waits for the current one (the gradients packed into the staging
buffer are ready), the collective is queued under it, and tensors the current stream made and may free at once
(stage 3's full-size gradients) are recorded on it so the caching allocator does not hand their memory out before
the collective has read them. Before a result is read the current stream waits for the communication stream
(`join`); the `StagingRing` (staging.py) does that when a slot is taken again or at the end of backward, before
the slot is refilled or its receive buffer delivered, so a pooled buffer is never written on one stream while the
other may still use it. The ring's buffers live as long as the engine, so they need no recording.

Stage 3's parameter all-gathers -- a unit's own and the ones its coordinator prefetches -- go on the same stream
(the ZeroModel's units take the ring's `CommStream`: one stream per engine). `Unit.start_gather` writes this
rank's row on the current stream and launches the all-gather under `launching()`, whose wait covers that row and
the last reader of the pooled gather buffer (the previous gather's unpack); `Unit.finish_gather` joins before
the buffer is read into the parameters, and only then gives the buffer back to the pool, so a pooled buffer is
never taken again while the communication stream may still write it. Pool buffers live as long as the engine,
so they need no recording either. (hpZ's gather from the secondary shard copies its row under `launching()` too:
the secondary shard is written only on the current stream, after a join.) One stream is one queue: a gather
launched after a reduction starts once that reduction is done, and its join waits for the reductions queued
before it.

Stages 1 and 2 launch the gathers of their updated pieces on the same stream (stage 2 shares its ring's), span
by span ([Note: overlapped gather of the updated pieces] in span_step.py): `launching()` waits for the span's
update on the current stream, and the step joins once every gather was waited for. The flat params live as
long as the engine, so they need no recording.

On a device without streams (the CPU: gloo's collectives are async work items and `wait()` is the only order)
`CommStream` holds no stream and every method returns at once: nothing is created, waited for or recorded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

from slipstream.accelerator import Accelerator, get_accelerator
from slipstream.accelerator.base import StreamLike


class CommStream:
    """One engine's communication stream: `launching()` around a collective's launch, `join()` before its result
    is read. Without `enabled` or on a device without streams it is a no-op."""

    def __init__(self, *, enabled: bool, accelerator: Accelerator | None = None) -> None:
        self._accelerator = accelerator if accelerator is not None else get_accelerator()
        self.stream: StreamLike | None = None
        if enabled and self._accelerator.has_streams():
            self.stream = self._accelerator.Stream()

    @contextlib.contextmanager
    def launching(self, keep: Iterable[torch.Tensor] = ()) -> Iterator[None]:
        """Queue what runs inside on the communication stream, after the work queued so far on the current one;
        each tensor of `keep` is recorded on the communication stream (its memory stays until the stream passes)."""
        stream = self.stream
        if stream is None:
            yield
            return
        stream.wait_stream(self._accelerator.current_stream())
        with self._accelerator.stream(stream):
            yield
        for tensor in keep:
            tensor.record_stream(stream)  # type: ignore[arg-type]

    def join(self) -> None:
        """Make the current stream wait for everything queued on the communication stream so far."""
        if self.stream is not None:
            self._accelerator.current_stream().wait_stream(self.stream)

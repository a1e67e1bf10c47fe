"""The collectives of ZeRO, as thin typed wrappers over torch.distributed that are counted and time out.

Every collective Slipstream issues goes through here (docs/design.md D13). Each one is counted
(`counting.py`), numbered and recorded in the store (see [Note: collective sequence numbers] in
`arrivals.py`), given aliases of its tensors (see [Note: handing tensors to gloo] in `inflight.py`), and
waited on with a timeout: a rank that never arrives makes the others raise
`CollectiveTimeout` naming the operation, its number, the ranks that arrived and those that did not,
instead of hanging. The timeout is the config's `collective_timeout` (seconds), else `SLIPSTREAM_TIMEOUT` seconds, else `DEEPSPEED_TIMEOUT` minutes
(DeepSpeed's variable), else 5 minutes. Counted names are the logical operation: a reduce-scatter is
'reduce_scatter' whatever the backend does underneath.
On NCCL, `wait()` orders the current stream rather than blocking the host, so there the process group's
own timeout (set from the same value by `init_distributed`) is what fires.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

from slipstream.comm import arrivals, counting, inflight, teardown

# torch 2.13 renamed the flat-tensor collectives; older releases only have the first names.
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


_configured_timeout: list[float] = []


def set_collective_timeout(seconds: float | None) -> None:
    """Use `seconds` from now on (the config's `collective_timeout`); None returns to the environment's."""
    _configured_timeout[:] = [] if seconds is None else [float(seconds)]


def collective_timeout() -> datetime.timedelta:
    """The timeout of one collective (see the module doc)."""
    if _configured_timeout:
        return datetime.timedelta(seconds=_configured_timeout[0])
    if os.environ.get("SLIPSTREAM_TIMEOUT"):
        return datetime.timedelta(seconds=float(os.environ["SLIPSTREAM_TIMEOUT"]))
    if os.environ.get("DEEPSPEED_TIMEOUT"):
        return datetime.timedelta(minutes=float(os.environ["DEEPSPEED_TIMEOUT"]))
    return datetime.timedelta(minutes=5)


class CollectiveTimeout(RuntimeError):
    """A collective did not complete: some ranks never reached it (or failed on the way)."""

    def __init__(self, op: str, seq: int, tensor: torch.Tensor, cause: BaseException) -> None:
        world = dist.get_world_size()
        me = dist.get_rank()
        last = arrivals.last_arrivals(world)
        arrived = sorted(r for r, a in last.items() if a is not None and a.seq >= seq)
        missing = sorted(set(range(world)) - set(arrived) - {me})
        arrived = sorted(set(arrived) | {me})
        doing = "; ".join(_describe(r, last[r]) for r in missing)
        self.op, self.seq, self.arrived, self.missing = op, seq, arrived, missing
        super().__init__(
            f"collective {op} #{seq} ({tuple(tensor.shape)}, {tensor.dtype}) did not complete on rank {me} within "
            f"{collective_timeout().total_seconds():g} s: arrived ranks {arrived}, missing ranks {missing}"
            f"{' (' + doing + ')' if doing else ''}. Every rank must run the same forward/backward/step and the "
            f"same collective calls (save_checkpoint too). Underlying error: {cause}")


def _describe(rank: int, arrival: arrivals.Arrival | None) -> str:
    return f"rank {rank} reached no collective" if arrival is None else \
        f"rank {rank} last reached #{arrival.seq} {arrival.op}"


class TimedWork:
    """An in-flight collective; `wait()` raises CollectiveTimeout instead of blocking forever."""

    def __init__(self, entry: inflight.Handed, op: str, seq: int, tensor: torch.Tensor) -> None:
        self._entry, self._op, self._seq, self._tensor = entry, op, seq, tensor

    def wait(self) -> None:
        work = self._entry.work
        if work is None:
            return
        try:
            if self._tensor.device.type == "cpu":
                work.wait(timeout=collective_timeout())
            else:
                work.wait()
        except RuntimeError as exc:
            inflight.abandon(self._entry)  # its worker may wait on the peer for good: never join it
            raise CollectiveTimeout(self._op, self._seq, self._tensor, exc) from exc
        self._entry.work = None  # the backend's worker now holds the last reference to the work, briefly


def _issue(op: str, tensor: torch.Tensor, tensors: tuple[torch.Tensor, ...], launch: Any,
           async_op: bool) -> TimedWork:
    """Count, number and launch one collective on aliases of `tensors` (the backend sees only those; `tensor`
    is the one counted and described); wait for it unless `async_op` (the caller then waits)."""
    teardown.install(created=False)  # a group created elsewhere still needs its collectives drained at exit
    counting.record(op, tensor)
    seq = arrivals.record(op)
    entry = inflight.hand(tensors, f"{op} #{seq}")
    entry.work = launch(*entry.aliases)
    work = TimedWork(entry, op, seq, tensor)
    if not async_op:
        work.wait()
    return work


def all_reduce(tensor: torch.Tensor, *, group: dist.ProcessGroup | None = None,
               async_op: bool = False) -> TimedWork:
    """Sum `tensor` across the ranks of `group`, in place."""
    return _issue("all_reduce", tensor, (tensor,), lambda t: dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group,
                                                                              async_op=True), async_op)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, *, group: dist.ProcessGroup | None = None,
                   async_op: bool = False) -> TimedWork:
    """Sum `input` (world * output.numel() elements) across ranks; rank r receives chunk r in `output`."""
    return _issue("reduce_scatter", input, (input, output), lambda i, o: _reduce_scatter_flat(
        o, i, op=dist.ReduceOp.SUM, group=group, async_op=True), async_op)


def all_gather(output: torch.Tensor, input: torch.Tensor, *, group: dist.ProcessGroup | None = None,
               async_op: bool = False) -> TimedWork:
    """Concatenate every rank's `input` into `output` (may be in place: input is output's chunk r)."""
    return _issue("all_gather", output, (output, input), lambda o, i: _all_gather_flat(o, i, group=group,
                                                                                         async_op=True), async_op)


def broadcast(tensor: torch.Tensor, src: int, *, group: dist.ProcessGroup | None = None) -> None:
    """Copy `tensor` from global rank `src` to every rank of `group`."""
    _issue("broadcast", tensor, (tensor,), lambda t: dist.broadcast(t, src=src, group=group, async_op=True), False)


def barrier(group: dist.ProcessGroup | None = None) -> None:
    nothing = torch.empty(0)
    _issue("barrier", nothing, (nothing,), lambda _: dist.barrier(group=group, async_op=True), False)

"""The collectives of ZeRO, as thin typed wrappers over torch.distributed that are counted and time out.

Every collective Slipstream issues goes through here (docs/design.md D13). Each one is counted
(`counting.py`), numbered and recorded in the store with its identity (see [Note: collective sequence
numbers] in `arrivals.py`), given aliases of its tensors (see [Note: handing tensors to gloo] in
`inflight.py`) and waited on against a deadline: a rank that never arrives, or a peer that dies, makes the
others raise `CollectiveTimeout` or `PeerLost` (errors.py) naming the operation, where it was issued, the
ranks that arrived and those that did not, instead of hanging.

The timeout is, in order of precedence: the config's `collective_timeout` (seconds),
`init_distributed(timeout=...)`, `SLIPSTREAM_TIMEOUT` seconds, `DEEPSPEED_TIMEOUT` minutes (DeepSpeed's variable),
else 5 minutes. It is the process group's own timeout too (given when Slipstream creates the group, and through
`set_timeout` to a group that exists), so gloo's operations and any point-to-point call give up at the same
deadline. On the host Slipstream also keeps its own deadline, measured from the launch, through
`Work.wait(timeout=...)`; gloo's flat reduce-scatter returns a work whose wait ignores that timeout and which never
reports completion, so a host reduce-scatter is issued here as what gloo runs for it anyway (a copy of the input,
an all-reduce, chunk r copied out), or on two ranks as a point-to-point exchange (see `reduce_scatter`). On NCCL
`wait()` orders the current stream rather than blocking the host, so there the group's timeout is what fires.
Counted names are the logical operation: a reduce-scatter is 'reduce_scatter' whatever the backend does underneath.
"""

from __future__ import annotations

import datetime
import os
import sys
import time
from collections.abc import Callable, Sequence
from types import FrameType

import torch
import torch.distributed as dist

from slipstream.comm import arrivals, counting, inflight, teardown
from slipstream.comm.errors import CollectiveError, CollectiveTimeout, OpInfo, PeerLost, is_lost_peer

__all__ = [
    "CollectiveError",
    "CollectiveTimeout",
    "PeerLost",
    "TimedWork",
    "all_gather",
    "all_gather_by_exchange",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast",
    "collective_timeout",
    "first_rank",
    "reduce_scatter",
    "set_collective_timeout",
]

# torch 2.13 renamed the flat-tensor collectives; older releases only have the first names.
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_COMM_DIR = os.path.dirname(os.path.abspath(__file__))
_PACKAGE_DIR = os.path.dirname(_COMM_DIR)
_LIBRARY_DIRS = (_PACKAGE_DIR, os.path.dirname(torch.__file__))  # a backward hook's caller is autograd's frame

_configured_timeout: list[float] = []


def set_collective_timeout(seconds: float | None) -> None:
    """Use `seconds` from now on (the config's `collective_timeout`, or `init_distributed(timeout=...)`), for
    Slipstream's deadline and for the default process group's own; None returns to the environment's."""
    _configured_timeout[:] = [] if seconds is None else [float(seconds)]
    apply_to_group()


def configured_timeout() -> datetime.timedelta | None:
    """The timeout someone chose (config, init_distributed, environment), or None for the default."""
    if _configured_timeout:
        return datetime.timedelta(seconds=_configured_timeout[0])
    if os.environ.get("SLIPSTREAM_TIMEOUT"):
        return datetime.timedelta(seconds=float(os.environ["SLIPSTREAM_TIMEOUT"]))
    if os.environ.get("DEEPSPEED_TIMEOUT"):
        return datetime.timedelta(minutes=float(os.environ["DEEPSPEED_TIMEOUT"]))
    return None


def collective_timeout() -> datetime.timedelta:
    """The timeout of one collective (see the module doc)."""
    return configured_timeout() or datetime.timedelta(minutes=5)


def apply_to_group() -> None:
    """Give the default process group the chosen timeout, so the backend's own operations (and any
    point-to-point call) give up when Slipstream's deadline does. A group nobody chose a timeout for keeps its own."""
    chosen = configured_timeout()
    if chosen is None or not (dist.is_available() and dist.is_initialized()):
        return
    group = dist.group.WORLD
    if group is not None and hasattr(group, "set_timeout"):
        group.set_timeout(chosen)


def _sites() -> tuple[str, str]:
    """(the line that issued the collective, the first line outside Slipstream and torch that led there, or '')."""
    frame = sys._getframe(2)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_COMM_DIR):
        frame = frame.f_back
    site = _where(frame)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        frame = frame.f_back
    origin = _where(frame)
    return site, "" if origin == site else origin


def _where(frame: FrameType) -> str:
    path = frame.f_code.co_filename
    shown = (
        "slipstream/" + os.path.relpath(path, _PACKAGE_DIR) if path.startswith(_PACKAGE_DIR) else os.path.basename(path)
    )
    return f"{shown}:{frame.f_lineno} ({frame.f_code.co_name})"


class TimedWork:
    """An in-flight collective; `wait()` raises CollectiveTimeout or PeerLost instead of blocking forever."""

    def __init__(self, entry: inflight.Handed, info: OpInfo, device: str, finish: Callable[[], object] | None) -> None:
        self._entry, self._info, self._device, self._finish = entry, info, device, finish
        self._started = time.monotonic()
        self._done = False

    def wait(self) -> None:
        if self._done:
            return
        if self._device == "cpu":
            self._wait_host()
            inflight.settle(self._entry)
        elif self._entry.work is not None:
            try:
                self._entry.work.wait()  # orders the stream; the group's own timeout fires on NCCL
            except RuntimeError as exc:
                self._entry.error = exc.with_traceback(None)
            self._entry.work = None
        self._done = True
        if self._entry.error is not None:
            raise self._failure(self._entry.error)
        counting.record_time(self._info.kind, time.monotonic() - self._started)
        if self._finish is not None:
            self._finish()
        inflight.prune()  # drop the aliases now if the backend already let go ([Note: handing tensors to gloo])

    def _wait_host(self) -> None:
        work = self._entry.work
        if work is None:  # seen complete already (inflight polls on every launch)
            return
        left = self._started + self._info.timeout_s - time.monotonic()
        try:
            work.wait(timeout=datetime.timedelta(seconds=max(left, 0.001)))  # 0 would mean: no timeout
        except RuntimeError as exc:
            if not work.is_completed():  # the deadline passed while the backend still waits on a peer, or a
                # point-to-point work (which reports completion only once waited for) lost its peer
                inflight.abandon(self._entry)  # its worker may wait for good: never join it
                self._done = True
                raise self._failure(exc.with_traceback(None) if is_lost_peer(exc) else None) from None
            self._entry.error = exc.with_traceback(None)
        self._entry.work = None

    def _failure(self, cause: BaseException | None) -> CollectiveError:
        elapsed = time.monotonic() - self._started
        if cause is None or "timed out" in str(cause).lower():
            return CollectiveTimeout(self._info, elapsed, cause)
        if is_lost_peer(cause):
            return PeerLost(self._info, elapsed, cause)
        return CollectiveError(self._info, elapsed, cause, "failed")


def _issue(
    kind: str,
    shown: torch.Tensor,
    tensors: tuple[torch.Tensor, ...],
    launch: Callable[..., object],
    async_op: bool,
    finish: Callable[[], object] | None = None,
    group: dist.ProcessGroup | None = None,
) -> TimedWork:
    """Count, number, record and launch one collective on aliases of `tensors` (the backend sees only those;
    `shown` is what the error describes); `finish` runs once it completed. Waits unless `async_op` (the
    caller then waits); `group` is the process group, for the counters."""
    teardown.install(created=False)  # a group created elsewhere still needs its collectives drained at exit
    site, origin = _sites()
    counting.record(kind, shown, site, group)
    identity = f"{kind} {shown.numel()} {site}"
    seq = arrivals.record(identity)
    info = OpInfo(
        kind,
        seq,
        identity,
        tuple(shown.shape),
        str(shown.dtype).removeprefix("torch."),
        site,
        origin,
        collective_timeout().total_seconds(),
    )
    entry = inflight.hand(tensors, f"{kind} #{seq} from {site}")
    try:
        entry.work = launch(*entry.aliases)
    except RuntimeError as exc:  # gloo raises at once when a peer is already gone
        entry.error = exc.with_traceback(None)
    work = TimedWork(entry, info, shown.device.type, finish)
    if not async_op:
        work.wait()
    return work


def all_reduce(
    tensor: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
) -> TimedWork:
    """Sum (or reduce with `op`) `tensor` across the ranks of `group`, in place."""
    return _issue(
        "all_reduce",
        tensor,
        (tensor,),
        lambda t: dist.all_reduce(t, op=op, group=group, async_op=True),
        async_op,
        group=group,
    )


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    input_is_scratch: bool = False,
) -> TimedWork:
    """Sum `input` (world * output.numel() elements) across ranks; rank r receives chunk r in `output`.

    `input_is_scratch`: the caller neither reads `input` after the call nor writes it before the work completes
    (a staging buffer it refills), so on the host it may be used in place instead of a copy; its values are then
    unspecified. Without it `input` is left as it was, as on the device.

    On the host this is, in general, what gloo itself does for a flat reduce-scatter (a copy of `input`, an
    all-reduce of it, chunk r copied out), issued here so that the all-reduce's completion can be watched:
    gloo's own version returns a work that never reports completion and whose wait() ignores its timeout. On
    two ranks with a scratch `input` and a separate `output` it is a point-to-point exchange instead: each rank
    sends its peer's chunk and receives its own from the peer into `output`, then adds its own chunk (the same
    two-addend sum the all-reduce makes, bit for bit). That sends half the bytes of the all-reduce and skips
    its all-gather half: on 2 ranks with 4M-element chunks, 12-16 ms against 28-34 ms. It was first set aside
    for an exit abort that turned out to be the release race of [Note: handing tensors to gloo], since fixed.
    """
    if input.device.type != "cpu":
        return _issue(
            "reduce_scatter",
            input,
            (input, output),
            lambda i, o: _reduce_scatter_flat(o, i, op=dist.ReduceOp.SUM, group=group, async_op=True),
            async_op,
            group=group,
        )
    if input_is_scratch and dist.get_world_size(group) == 2 and not _same_storage(output, input):
        return _reduce_scatter_pair(output, input, group=group, async_op=async_op)
    summed = input if input_is_scratch else input.clone()
    chunk = summed.chunk(dist.get_world_size(group))[dist.get_rank(group)]
    return _issue(
        "reduce_scatter", input, (summed,), _sum_in_place(group), async_op, lambda: output.copy_(chunk), group=group
    )


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _reduce_scatter_pair(
    output: torch.Tensor, input: torch.Tensor, *, group: dist.ProcessGroup | None, async_op: bool
) -> TimedWork:
    """`reduce_scatter` on two host ranks (see there): the peer's chunk of `input` out, this rank's chunk from
    the peer into `output`, then this rank's own chunk added."""
    rank = dist.get_rank(group)
    peer = 1 - rank
    chunks = input.chunk(2)
    own, theirs = chunks[rank], chunks[peer]

    def launch(received: torch.Tensor, sent: torch.Tensor) -> _AllOf:
        return _AllOf(_swap(sent, received, peer, group=group, tag=_PAIR_TAG))

    return _issue("reduce_scatter", input, (output, theirs), launch, async_op, lambda: output.add_(own), group=group)


def all_gather(
    output: torch.Tensor, input: torch.Tensor, *, group: dist.ProcessGroup | None = None, async_op: bool = False
) -> TimedWork:
    """Concatenate every rank's `input` into `output` (may be in place: input is output's chunk r)."""
    return _issue(
        "all_gather",
        output,
        (output, input),
        lambda o, i: _all_gather_flat(o, i, group=group, async_op=True),
        async_op,
        group=group,
    )


def all_gather_by_exchange(
    tensor: torch.Tensor,
    parts: Sequence[Sequence[torch.Tensor]],
    *,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> TimedWork:
    """An in-place all-gather of disjoint parts of `tensor` by point-to-point exchange: `parts[r]` are the views
    of `tensor` rank r owns (the same number on every rank); this rank sends its own to every other rank and
    receives theirs in place. gloo's all-gather copies through a temporary as large as its output; this needs
    none, and on 2 ranks sends half the bytes of an all-reduce of `tensor`, with no sum. Counted as one
    all-gather of `tensor`. The host's choice ([Note: gathering the pieces] in zero/flat_group.py)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    flat_parts = [p for row in parts for p in row]

    def launch(*aliases: torch.Tensor) -> _AllOf:
        rows, works, start = [], [], 0
        for row in parts:
            rows.append(aliases[start : start + len(row)])
            start += len(row)
        for peer in (r for r in range(world) if r != rank):
            for mine, theirs in zip(rows[rank], rows[peer], strict=True):
                works += _swap(mine, theirs, peer, group=group, tag=_EXCHANGE_TAG)
        return _AllOf(works)

    return _issue("all_gather", tensor, tuple(flat_parts), launch, async_op, group=group)


def _swap(
    sent: torch.Tensor, received: torch.Tensor, peer: int, *, group: dist.ProcessGroup | None, tag: int
) -> list[dist.Work | None]:
    """Send `sent` to `peer` (a rank of `group`) and receive `received` from it: the two point-to-point works."""
    target = peer if group is None else dist.get_global_rank(group, peer)
    return [
        dist.isend(sent, dst=target, group=group, tag=tag),
        dist.irecv(received, src=target, group=group, tag=tag),
    ]


_EXCHANGE_TAG = 0x7FFF0000
"""The point-to-point tag of `all_gather_by_exchange` (the pipeline's tags are small numbers)."""
_PAIR_TAG = _EXCHANGE_TAG + 1
"""The point-to-point tag of the two-rank host reduce-scatter."""


class _AllOf:
    """Several backend works waited for as one, within one deadline (the exchange's sends and receives)."""

    def __init__(self, works: list[dist.Work | None]) -> None:
        self._works = [work for work in works if work is not None]

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        for work in self._works:
            if deadline is None:
                work.wait()
            else:
                work.wait(timeout=datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


def _sum_in_place(group: dist.ProcessGroup | None) -> Callable[[torch.Tensor], object]:
    """The launch of an asynchronous in-place sum over `group` (what the host's reduce-scatter runs)."""
    return lambda t: dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=True)


def all_to_all(
    output: torch.Tensor, input: torch.Tensor, *, group: dist.ProcessGroup | None = None, async_op: bool = False
) -> TimedWork:
    """Split `input` into world equal chunks along dim 0; chunk j goes to rank j, and rank j's chunk for this
    rank lands in chunk j of `output` (same shape as `input`). gloo, NCCL and the CPU backends all run it."""
    return _issue(
        "all_to_all",
        input,
        (output, input),
        lambda o, i: dist.all_to_all_single(o, i, group=group, async_op=True),
        async_op,
        group=group,
    )


def first_rank(group: dist.ProcessGroup | None) -> int:
    """Global rank of `group`'s rank 0 (the `src` of a broadcast from the group's first member)."""
    return 0 if group is None else dist.get_global_rank(group, 0)


def broadcast(tensor: torch.Tensor, src: int, *, group: dist.ProcessGroup | None = None) -> None:
    """Copy `tensor` from global rank `src` to every rank of `group`."""
    _issue("broadcast", tensor, (tensor,), lambda t: dist.broadcast(t, src, group, True), False, group=group)


def barrier(group: dist.ProcessGroup | None = None) -> None:
    nothing = torch.empty(0)
    _issue("barrier", nothing, (nothing,), lambda _: dist.barrier(group=group, async_op=True), False)

"""The communication benchmark (DeepSpeed's ds_bench): time each collective over a range of sizes on the
current world and give its algorithm and bus bandwidth. `slipstream bench comm` (cli/bench.py) prints it.

[Note: what the comm benchmark times]
The timed calls go to torch.distributed directly, not through `collectives.py`: the wrappers record every
call in the store (a TCP round trip, see arrivals.py) and in the counters, bookkeeping that is no part of
the communication and would dominate small messages, and they have no all_to_all or send/recv. Each call
is issued with `async_op=True` and waited with a plain `wait()`: the process group's own timeout bounds it
(gloo raises "Timed out waiting ... for send operation" when a peer never comes, NCCL's watchdog fires), and
`init_distributed` sets that timeout from the collective timeout, so a missing rank still raises instead
of hanging (P2) with nothing computed per call. The untimed coordination (the barrier before each
measurement, agreeing whether an op runs, gathering the per-call times) goes through the wrappers.

One measurement: `warmups` untimed calls, a barrier, then `trials` calls back to back, each waited and timed.
A call's time is that of its slowest rank; `time_s` is the median over the calls and `mean_time_s` the mean
(nccl-tests' and ds_bench's figure, elapsed / trials). The median is the headline because on a shared
machine a rank that is descheduled for a few milliseconds inflates the mean of a whole measurement (on
the project's 2-core machines the mean of one measurement varied 2-5x from one to the next, the median of
the calls far less). Sizes follow nccl-tests:
the size of all_reduce and broadcast is the buffer, of all_gather the gathered output, of reduce_scatter
the input being reduced, of all_to_all what each rank sends, of p2p what each sender sends (ranks of the
first half send to their partner rank + world/2, all pairs at once). algbw = size / time; busbw = algbw *
the op's factor (BUS_FACTORS), which makes figures of different ops and world sizes comparable to the link.

An op the backend cannot run (gloo lacks some collectives on some torch versions) is found by one small
call on every rank; the ranks agree, and the op is reported as unsupported with the backend's error.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from slipstream.comm import collectives

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "p2p")

BUS_FACTORS: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "p2p": lambda n: 1.0,
}
"""busbw / algbw per op for a world of n ranks (nccl-tests' factors)."""

Issue = Callable[[], list[Any]]
"""Starts one call of an op on its buffers; returns the in-flight works to wait on."""


@dataclasses.dataclass(frozen=True, slots=True)
class CommResult:
    """One (op, size) measurement; `unsupported` is the reason when the backend cannot run the op."""

    op: str
    size_bytes: int
    elements: int
    dtype: str
    world_size: int
    trials: int
    time_s: float = float("nan")
    mean_time_s: float = float("nan")
    algbw_gb_s: float = float("nan")
    busbw_gb_s: float = float("nan")
    unsupported: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def elements_for(op: str, nbytes: int, element_size: int, world: int) -> int:
    """Elements of the op's size (see the module doc) nearest below `nbytes`: a multiple of the world for the
    ops that split their buffer in per-rank chunks, and never fewer than one element per rank."""
    numel = max(1, nbytes // element_size)
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        numel = max(world, numel // world * world)
    return numel


def _p2p_peer(rank: int, world: int) -> tuple[str, int] | None:
    half = world // 2
    if rank < half:
        return "send", rank + half
    if rank < 2 * half:
        return "recv", rank - half
    return None  # the last rank of an odd world has no partner


def make_issue(op: str, numel: int, dtype: torch.dtype, device: torch.device) -> Issue:
    """Allocate the op's buffers once and return the function that starts one call on them."""
    rank, world = dist.get_rank(), dist.get_world_size()
    chunk = numel // world
    big = torch.ones(numel, dtype=dtype, device=device)
    if op == "all_reduce":
        return lambda: [dist.all_reduce(big, async_op=True)]
    if op == "broadcast":
        return lambda: [dist.broadcast(big, src=0, async_op=True)]
    small = torch.ones(chunk, dtype=dtype, device=device)
    if op == "all_gather":
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: [gather(big, small, async_op=True)]
    if op == "reduce_scatter":
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: [scatter(small, big, async_op=True)]
    if op == "all_to_all":
        received = torch.empty_like(big)
        return lambda: [dist.all_to_all_single(received, big, async_op=True)]
    if op == "p2p":
        peer = _p2p_peer(rank, world)
        if peer is None:
            return list  # the last rank of an odd world: nothing to issue
        start = dist.isend if peer[0] == "send" else dist.irecv
        return lambda: [start(big, peer[1])]
    raise ValueError(f"unknown op {op!r}; the benchmark has {', '.join(OPS)}")


def _wait(works: list[dist.Work]) -> None:
    for work in works:
        work.wait()  # bounded by the process group's timeout (see the module doc)


def _agree_supported(op: str, issue: Issue, device: torch.device) -> str | None:
    """Run one call on every rank; None when every rank could, else the reason (this rank's error if any)."""
    reason = None
    if op == "p2p" and dist.get_world_size() < 2:
        return "point-to-point needs 2 or more ranks; this world has 1"
    try:
        _wait(issue())
    except (RuntimeError, NotImplementedError, ValueError, TypeError) as error:
        reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    failed = torch.tensor([0 if reason is None else 1], dtype=torch.int32, device=device)
    collectives.all_reduce(failed)
    if int(failed.item()) == 0:
        return None
    return reason or "failed on another rank"


def _slowest_per_call(seconds: list[float], device: torch.device) -> list[float]:
    """Every call's time on its slowest rank (an all_gather of the per-call times through the wrapper)."""
    mine = torch.tensor(seconds, dtype=torch.float64, device=device)
    every = torch.empty(dist.get_world_size() * len(seconds), dtype=torch.float64, device=device)
    collectives.all_gather(every, mine)
    return [float(x) for x in every.view(dist.get_world_size(), len(seconds)).max(dim=0).values.cpu()]


def measure(
    op: str,
    nbytes: int,
    *,
    trials: int,
    warmups: int,
    dtype: torch.dtype,
    device: torch.device,
    synchronize: Callable[[], None],
) -> CommResult:
    """Time `op` at about `nbytes` (see the module doc); every rank of the world must call it alike."""
    world = dist.get_world_size()
    element_size = torch.empty(0, dtype=dtype).element_size()
    numel = elements_for(op, nbytes, element_size, world)
    base = CommResult(
        op=op,
        size_bytes=numel * element_size,
        elements=numel,
        dtype=str(dtype).split(".")[-1],
        world_size=world,
        trials=trials,
    )
    issue = make_issue(op, numel, dtype, device)
    reason = _agree_supported(op, issue, device)
    if reason is not None:
        return dataclasses.replace(base, unsupported=reason)
    for _ in range(warmups):
        _wait(issue())
    synchronize()
    collectives.barrier()
    seconds = []
    for _ in range(trials):
        start = time.perf_counter()
        _wait(issue())
        synchronize()
        seconds.append(time.perf_counter() - start)
    per_call = _slowest_per_call(seconds, device)
    median = statistics.median(per_call)
    algbw = base.size_bytes / median / 1e9
    return dataclasses.replace(
        base,
        time_s=median,
        mean_time_s=statistics.fmean(per_call),
        algbw_gb_s=algbw,
        busbw_gb_s=algbw * BUS_FACTORS[op](world),
    )


def run(
    ops: Sequence[str], sizes: Sequence[int], *, trials: int = 20, warmups: int = 3, dtype: torch.dtype = torch.float32
) -> list[CommResult]:
    """Every op at every size, in that order, on the default process group (which must be initialized)."""
    from slipstream.accelerator import get_accelerator

    unknown = [op for op in ops if op not in OPS]
    if unknown:
        raise ValueError(f"unknown op(s) {', '.join(unknown)}; the benchmark has {', '.join(OPS)}")
    if trials < 1 or warmups < 0:
        raise ValueError(f"trials must be >= 1 and warmups >= 0 (got {trials} and {warmups})")
    accelerator = get_accelerator()
    device = torch.device(accelerator.current_device_name())
    results = []
    for op in ops:
        for nbytes in sizes:
            results.append(
                measure(
                    op,
                    nbytes,
                    trials=trials,
                    warmups=warmups,
                    dtype=dtype,
                    device=device,
                    synchronize=accelerator.synchronize,
                )
            )
    return results

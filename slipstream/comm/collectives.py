"""The collectives of ZeRO, as thin typed wrappers over torch.distributed that are counted.

Every collective Slipstream issues goes through here (ARCHITECTURE.md decision 7), so counting,
timeouts and sequence numbers have one home. Counted names are the logical operation: a reduce-scatter
is counted as 'reduce_scatter' whatever the backend does underneath.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from slipstream.comm import counting

Work = dist.Work
# torch 2.13 renamed the flat-tensor collectives; older releases only have the first names.
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_reduce(tensor: torch.Tensor, *, group: dist.ProcessGroup | None = None,
               async_op: bool = False) -> Work | None:
    """Sum `tensor` across the ranks of `group`, in place."""
    counting.record("all_reduce", tensor)
    return dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, *, group: dist.ProcessGroup | None = None,
                   async_op: bool = False) -> Work | None:
    """Sum `input` (world * output.numel() elements) across ranks; rank r receives chunk r in `output`."""
    counting.record("reduce_scatter", input)
    return _reduce_scatter_flat(output, input, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_gather(output: torch.Tensor, input: torch.Tensor, *, group: dist.ProcessGroup | None = None,
               async_op: bool = False) -> Work | None:
    """Concatenate every rank's `input` into `output` (may be in place: input is output's chunk r)."""
    counting.record("all_gather", output)
    return _all_gather_flat(output, input, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, *, group: dist.ProcessGroup | None = None) -> None:
    """Copy `tensor` from global rank `src` to every rank of `group`."""
    counting.record("broadcast", tensor)
    dist.broadcast(tensor, src=src, group=group)


def barrier(group: dist.ProcessGroup | None = None) -> None:
    counting.record("barrier", torch.empty(0))
    dist.barrier(group=group)

"""Sharding batches along the sequence dim for a sequence-parallel group (DeepSpeed's
`UlyssesSPDataLoaderAdapter`, simplified): every rank of the group reads the same batch and keeps its slice.

Slices follow `torch.chunk`: a sequence of 7 on 2 ranks gives 4 and 3 (see [Note: uneven sequence lengths] in
layer.py). Position ids of the slice are added under `position_ids` when the batch is a dict without them, so a
model that embeds positions sees the global positions of its tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["SequenceShardLoader", "sequence_mean_loss", "shard_sequence", "slice_bounds"]


def slice_bounds(length: int, rank: int, size: int) -> tuple[int, int]:
    """[start, end) of rank's slice of a sequence of `length` split like `torch.chunk` over `size` ranks."""
    step = -(-length // size)
    start = min(rank * step, length)
    return start, min(start + step, length)


def shard_sequence(
    batch: Any, group: dist.ProcessGroup | None, *, seq_dim: int = 1, keys: Sequence[str] | None = None
) -> Any:
    """This rank's slice of every tensor in `batch` (a tensor, tuple/list, or dict; for a dict only `keys` when
    given) with at least `seq_dim + 1` dims, along `seq_dim`."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)

    def cut(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() <= seq_dim:
            return t
        start, end = slice_bounds(t.shape[seq_dim], rank, size)
        return t.narrow(seq_dim, start, end - start)

    if isinstance(batch, dict):
        out = {k: cut(v) if keys is None or k in keys else v for k, v in batch.items()}
        ids = batch.get("input_ids")
        if "position_ids" not in batch and isinstance(ids, torch.Tensor) and ids.dim() > seq_dim:
            start, end = slice_bounds(ids.shape[seq_dim], rank, size)
            out["position_ids"] = torch.arange(start, end, device=ids.device).expand(*ids.shape[:seq_dim], -1)
        return out
    if isinstance(batch, (tuple, list)):
        return type(batch)(cut(t) for t in batch)
    return cut(batch)


def sequence_mean_loss(
    local_sum: torch.Tensor, local_count: int | torch.Tensor, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """The loss a rank of a sequence-parallel group should pass to `engine.backward`: its slice's summed token
    losses scaled so that the engine's average over the data x sequence ranks is the mean over every token of
    the sequence. With slices of unequal length (or ignored tokens) the mean of per-slice means is not that.
    One all-reduce of the token count (no gradient)."""
    count = torch.as_tensor(local_count, dtype=torch.float64, device=local_sum.device).reshape(1).clone()
    if dist.get_world_size(group) > 1:
        from slipstream.comm import collectives

        collectives.all_reduce(count, group=group)
    return local_sum * (dist.get_world_size(group) / float(count))


class SequenceShardLoader:
    """Wraps a loader: yields `shard_sequence(batch, group, seq_dim=...)` for each of its batches."""

    def __init__(self, loader: Iterable[Any], group: dist.ProcessGroup | None, *, seq_dim: int = 1) -> None:
        self.loader, self.group, self.seq_dim = loader, group, seq_dim

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            yield shard_sequence(batch, self.group, seq_dim=self.seq_dim)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

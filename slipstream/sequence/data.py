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

from slipstream.comm import collectives

__all__ = [
    "SequenceShardLoader",
    "UlyssesSPDataLoaderAdapter",
    "sequence_mean_loss",
    "shard_sequence",
    "slice_bounds",
    "with_shift_labels",
]


def slice_bounds(length: int, rank: int, size: int) -> tuple[int, int]:
    """[start, end) of rank's slice of a sequence of `length` split like `torch.chunk` over `size` ranks."""
    step = -(-length // size)
    start = min(rank * step, length)
    return start, min(start + step, length)


def shard_sequence(
    batch: object, group: dist.ProcessGroup | None, *, seq_dim: int = 1, keys: Sequence[str] | None = None
) -> Any:
    """This rank's slice of every tensor in `batch` (a tensor, tuple/list, or dict; for a dict only `keys` when
    given) with at least `seq_dim + 1` dims, along `seq_dim`."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)

    def cut(t: object) -> Any:
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
        collectives.all_reduce(count, group=group)
    return local_sum * (dist.get_world_size(group) / float(count))


class SequenceShardLoader:
    """Wraps a loader: yields `shard_sequence(batch, group, seq_dim=...)` for each of its batches."""

    def __init__(self, loader: Iterable[object], group: dist.ProcessGroup | None, *, seq_dim: int = 1) -> None:
        self.loader, self.group, self.seq_dim = loader, group, seq_dim

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            yield shard_sequence(batch, self.group, seq_dim=self.seq_dim)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]


class UlyssesSPDataLoaderAdapter:
    """DeepSpeed's loader adapter for Ulysses on Hugging Face models: every rank of the sequence-parallel group
    reads its own batches from `dl`; the group then trains on rank 0's batch, then rank 1's, ..., each rank
    holding its slice of the sequence of each. So one pass yields `len(dl) * sp_world_size` micro-batches per
    rank, and together the group covers every batch its ranks read, once.

    Each batch is a dict of tensors [batch, seq, ...] (every tensor is sliced along dim 1; other values are
    given to every rank as read). `labels` is replaced by `shift_labels`: the labels shifted left by one over
    the whole sequence, -100 after the last token, so a slice's last token is scored against the first label
    of the next slice (a model shifting inside its slice would lose that token). `position_ids`, when absent,
    are added as 0..seq-1 (sequences not packed; a packed batch must carry its own). Slices follow
    `torch.chunk` (a sequence of 7 on 2 ranks: 4 and 3), and the sequence length may differ between batches
    and ranks. Slices travel by one all-to-all per tensor (a rank receives only its slices), plus one
    exchange of shapes and non-tensor values per round; the slices are returned on the CPU, like DeepSpeed's
    (move them with `move_to_device`).
    """

    def __init__(
        self,
        dl: Iterable[object],
        sp_rank: int,
        sp_group: dist.ProcessGroup | None,
        sp_world_size: int,
        device: torch.device,
    ) -> None:
        if sp_world_size != dist.get_world_size(sp_group) or sp_rank != dist.get_rank(sp_group):
            raise ValueError(
                f"UlyssesSPDataLoaderAdapter: sp_rank={sp_rank}, sp_world_size={sp_world_size} do not match the "
                f"group (rank {dist.get_rank(sp_group)} of {dist.get_world_size(sp_group)}); pass "
                "groups._get_sequence_parallel_rank() and _get_sequence_parallel_world_size()"
            )
        self.dl, self.sp_rank, self.sp_group, self.sp_world_size = dl, sp_rank, sp_group, sp_world_size
        self.device = torch.device(device) if not isinstance(device, torch.device) else device
        self.iter: Iterator[Any] = iter(dl)
        self.micro_batches: list[dict[str, Any]] = []

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size  # type: ignore[arg-type]

    def __iter__(self) -> UlyssesSPDataLoaderAdapter:
        return self

    def __next__(self) -> dict[str, Any]:
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.pop(0)

    def refill(self) -> None:
        """Read one batch per rank and keep this rank's slice of each (collective over the group)."""
        try:
            batch = next(self.iter)
        except StopIteration:
            self.iter = iter(self.dl)  # the next epoch starts over
            raise
        if not isinstance(batch, dict) or "input_ids" not in batch:
            raise ValueError(
                f"UlyssesSPDataLoaderAdapter: batches must be dicts with 'input_ids' (and 'labels'), got "
                f"{type(batch).__name__}{sorted(batch) if isinstance(batch, dict) else ''}"
            )
        batch = with_shift_labels(batch)
        seq = batch["input_ids"].shape[1]
        for key, value in batch.items():
            if isinstance(value, torch.Tensor) and (value.dim() < 2 or value.shape[1] != seq):
                raise ValueError(
                    f"UlyssesSPDataLoaderAdapter: {key!r} has shape {tuple(value.shape)}; every tensor of a batch "
                    f"must be [batch, seq={seq}, ...] like input_ids"
                )
        size = self.sp_world_size
        meta = {k: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else ("value", v) for k, v in batch.items()}
        metas: list[Any] = [None] * size
        dist.all_gather_object(metas, meta, group=self.sp_group)
        if any(set(m) != set(meta) for m in metas):
            raise ValueError(
                f"UlyssesSPDataLoaderAdapter: the ranks' batches have different keys: {[sorted(m) for m in metas]}"
            )
        rounds: list[dict[str, Any]] = [{} for _ in range(size)]
        for key in batch:
            if metas[0][key][0] == "value":
                for source in range(size):
                    rounds[source][key] = metas[source][key][1]
                continue
            for source, piece in enumerate(self._exchange(batch[key], [m[key] for m in metas])):
                rounds[source][key] = piece
        self.micro_batches.extend(rounds)

    def _exchange(self, tensor: torch.Tensor, metas: list[Any]) -> list[torch.Tensor]:
        """This rank's slice of every rank's `tensor` (shapes `metas`): one all-to-all of padded flat slices."""
        size, rank = self.sp_world_size, self.sp_rank
        dtype = metas[0][1]
        if any(m[1] != dtype for m in metas):
            raise ValueError(f"UlyssesSPDataLoaderAdapter: a tensor has different dtypes on the ranks: {metas}")

        def slice_shape(shape: tuple[int, ...], r: int) -> tuple[int, ...]:
            start, end = slice_bounds(shape[1], r, size)
            return (shape[0], end - start, *shape[2:])

        def numel(shape: tuple[int, ...]) -> int:
            n = 1
            for d in shape:
                n *= d
            return n

        longest = max(numel(slice_shape(m[0], r)) for m in metas for r in range(size))
        send = torch.zeros(size, max(longest, 1), dtype=dtype, device=self.device)
        local = tensor.to(self.device)
        for r in range(size):
            start, end = slice_bounds(local.shape[1], r, size)
            piece = local.narrow(1, start, end - start).reshape(-1)
            send[r, : piece.numel()] = piece
        received = torch.empty_like(send)
        collectives.all_to_all(received, send, group=self.sp_group)
        out = []
        for source, meta in enumerate(metas):
            shape = slice_shape(meta[0], rank)
            out.append(received[source, : numel(shape)].reshape(shape).cpu().clone())
        return out


def with_shift_labels(batch: dict[str, Any]) -> dict[str, Any]:
    """`batch` with `labels` replaced by `shift_labels` (left by one over the whole sequence, -100 last) and
    `position_ids` added (0..seq-1 per row) when absent."""
    out = dict(batch)
    labels = out.pop("labels", None)
    if isinstance(labels, torch.Tensor):
        out["shift_labels"] = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    if "position_ids" not in out:
        ids = out["input_ids"]
        out["position_ids"] = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1).contiguous()
    return out

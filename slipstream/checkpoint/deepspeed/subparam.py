"""Parameters made of several sub-parameters (a fused q/k/v weight), and how tensor parallelism cuts them.

Owns `SubparamShape` (DeepSpeed's `deepspeed.checkpoint.universal_checkpoint.SubparamShape`, the record that
`universal_checkpoint_info` and a universal tensor file carry) and the two directions of the cut:

- `merge_rank_slices`: the ranks' slices of a fused parameter -> the whole parameter, sub-parameter by
  sub-parameter (each rank holds a piece of every sub-parameter, so concatenating the ranks end to end would
  interleave q, k and v).
- `rank_slice`: the whole parameter -> one rank's slice.

`widths[i][r]` is how many rows (along the partition dim) of sub-parameter i rank r holds; uneven widths are
how grouped-query attention with fewer key/value heads than ranks is split. Without recorded widths only an
even split can be reconstructed, and an uneven one is refused.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from slipstream.checkpoint.errors import ConversionMetadataError

__all__ = ["SubparamShape", "check_widths", "even_widths", "merge_rank_slices", "rank_slice", "resolve_placeholder"]


@dataclass
class SubparamShape:
    """The sub-parameter layout of the parameters whose names match `patterns`: `shape[partition_dim]` is the
    tuple of sub-parameter widths along the partition dim (or, in metadata older than version 0.4, their count);
    the other entries are the plain sizes of the remaining dims (-1: inferred)."""

    patterns: list[str]
    shape: Any
    partition_dim: int


def even_widths(sizes: Sequence[int], tp_size: int, what: str) -> list[list[int]]:
    """The widths of an even split of each sub-parameter; refuses sizes the ranks do not divide."""
    uneven = [size for size in sizes if size % tp_size]
    if uneven:
        raise ConversionMetadataError(
            f"{what}: sub-parameter sizes {uneven} are not divisible by tp_world_size {tp_size} (the tensor-parallel "
            "size) and no "
            "sub_param_shard_widths were recorded, so the uneven split cannot be reconstructed; re-save with a "
            "writer that records the widths (universal checkpoint version 0.4)"
        )
    return [[size // tp_size] * tp_size for size in sizes]


def check_widths(widths: Sequence[Sequence[int]], sizes: Sequence[int], tp_size: int, what: str) -> None:
    if len(widths) != len(sizes):
        raise ConversionMetadataError(
            f"{what}: {len(widths)} shard-width entries for {len(sizes)} sub-parameters {list(sizes)}"
        )
    for size, row in zip(sizes, widths):
        if len(row) != tp_size:
            raise ConversionMetadataError(
                f"{what}: the sub-parameter of size {size} has {len(row)} shard widths {list(row)}, one per "
                f"tensor-parallel rank ({tp_size}) expected"
            )
        if sum(row) != size:
            raise ConversionMetadataError(
                f"{what}: shard widths {list(row)} sum to {sum(row)}, but the sub-parameter has {size} rows"
            )


def resolve_placeholder(shape: Sequence[int], numel: int, what: str) -> list[int]:
    """`shape` with its one negative entry (if any) replaced so that the shape holds `numel` elements."""
    holes = [i for i, dim in enumerate(shape) if dim is not None and dim < 0]
    if not holes:
        return list(shape)
    known = math.prod(dim for i, dim in enumerate(shape) if i not in holes)
    if len(holes) > 1 or known <= 0 or numel % known:
        raise ConversionMetadataError(
            f"{what}: the sub-parameter view {list(shape)} cannot be resolved for {numel} elements (one -1 entry, "
            "dividing the element count, is allowed)"
        )
    out = list(shape)
    out[holes[0]] = numel // known
    return out


def merge_rank_slices(
    slices: Sequence[torch.Tensor], logical_shape: Sequence[int], dim: int, widths: Sequence[Sequence[int]], what: str
) -> torch.Tensor:
    """The whole parameter from the ranks' slices: for each sub-parameter, each rank's piece in rank order."""
    views = []
    for rank, piece in enumerate(slices):
        shape = list(logical_shape)
        shape[dim] = sum(row[rank] for row in widths)
        if math.prod(shape) != piece.numel():
            raise ConversionMetadataError(
                f"{what}: tensor-parallel rank {rank} holds {piece.numel()} elements, but its recorded shard widths "
                f"describe a {tuple(shape)} slice; the metadata belongs to another parameter"
            )
        views.append(piece.reshape(shape))
    starts = [0] * len(views)
    parts = []
    for row in widths:
        for rank, view in enumerate(views):
            parts.append(view.narrow(dim, starts[rank], row[rank]))
            starts[rank] += row[rank]
    return torch.cat(parts, dim=dim)


def rank_slice(
    full: torch.Tensor, dim: int, sizes: Sequence[int], widths: Sequence[Sequence[int]], rank: int
) -> torch.Tensor:
    """Rank `rank`'s slice of the whole parameter `full` (shaped so that `dim` is the partition dim)."""
    if sum(sizes) != full.shape[dim]:
        raise ConversionMetadataError(
            f"sub-parameter sizes {list(sizes)} sum to {sum(sizes)}, but dim {dim} of the parameter has "
            f"{full.shape[dim]} rows; the metadata belongs to another parameter"
        )
    parts = []
    offset = 0
    for size, row in zip(sizes, widths):
        parts.append(full.narrow(dim, offset + sum(row[:rank]), row[rank]))
        offset += size
    return torch.cat(parts, dim=dim)

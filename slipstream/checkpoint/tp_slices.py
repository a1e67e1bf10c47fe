"""Checkpoints of tensor-parallel models hold global tensors: each rank's slices of its TP shard are mapped
to flat ranges of the global tensor, so a TP=2 checkpoint loads at TP=1 (or any TP size, or none).

A shard cut along dim 0 is one contiguous range of the global tensor (offset by its first row). A shard cut
along dim 1 (a row-parallel weight) is one range per row it covers. Replicated parameters are written by the
group's first rank only (the others hold the same values), and read by every rank.
"""

from __future__ import annotations

import dataclasses
import math

from slipstream.zero.slices import OwnedSlice

__all__ = ["TpLayout", "to_global"]


@dataclasses.dataclass(frozen=True, slots=True)
class TpLayout:
    """Where one parameter's local shard sits in its global tensor."""

    global_shape: tuple[int, ...]
    shard_dim: int | None
    """None: replicated over the TP group."""
    start: int
    """First index of the shard along `shard_dim`."""


def to_global(
    slices: list[OwnedSlice], layouts: dict[str, TpLayout], *, tp_rank: int, for_save: bool
) -> list[OwnedSlice]:
    out: list[OwnedSlice] = []
    for piece in slices:
        layout = layouts.get(piece.name)
        if layout is None:
            out.append(piece)
        elif layout.shard_dim is None:
            if not (for_save and tp_rank != 0):
                out.append(piece)
        elif layout.shard_dim == 0:
            offset = layout.start * math.prod(layout.global_shape[1:])
            out.append(_moved(piece, layout.global_shape, 0, piece.numel, piece.lo + offset))
        elif layout.shard_dim == 1 and len(piece.shape) == 2:
            local_cols, global_cols = piece.shape[1], layout.global_shape[1]
            row = piece.lo // local_cols
            while row * local_cols < piece.hi:
                a, b = max(piece.lo, row * local_cols), min(piece.hi, (row + 1) * local_cols)
                lo = row * global_cols + layout.start + a - row * local_cols
                out.append(_moved(piece, layout.global_shape, a - piece.lo, b - piece.lo, lo))
                row += 1
        else:
            raise NotImplementedError(
                f"checkpoint of tensor-parallel parameter '{piece.name}' sharded along dim {layout.shard_dim} of "
                f"{len(piece.shape)}: only dims 0 and 1 (of 2-D weights) are mapped to global tensors"
            )
    return out


def _moved(piece: OwnedSlice, shape: tuple[int, ...], a: int, b: int, lo: int) -> OwnedSlice:
    """Elements [a, b) of `piece` (relative to its lo) as the global range starting at `lo`."""
    return dataclasses.replace(
        piece,
        shape=shape,
        lo=lo,
        hi=lo + b - a,
        value=piece.value.reshape(-1)[a:b],
        master=None if piece.master is None else piece.master.reshape(-1)[a:b],
        piece_offset=piece.piece_offset + a,
    )

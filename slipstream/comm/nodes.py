"""Which ranks share a node, and the two-level groups built on it (ZeRO++'s hpZ and qgZ, MiCS).

A ZeRO group of `n` ranks is cut into blocks of `size` consecutive members (its "inner" groups: one node when
`size` is the number of ranks per node, which is how launchers number ranks) and, across the blocks, the
members at the same position (its "outer" groups). hpZ keeps its secondary copy over an inner group, MiCS shards
over inner groups and all-reduces across outer ones, qgZ reduces inside a node before it sends across nodes.

Ranks per node come from `LOCAL_WORLD_SIZE` (set by torchrun and by Slipstream's launcher), so a test can
simulate 2 "nodes" x 2 on one machine by setting it to 2 in 4 rank processes. Process groups are collective to
create: over the whole world every rank builds every inner and outer group of a (group, size) pair in the
same order, once; over a sub-group each member builds only its own two, synchronised among their members.
"""

from __future__ import annotations

import dataclasses
import os

import torch.distributed as dist

__all__ = ["TwoLevel", "ranks_per_node", "two_level_groups"]

LOCAL_WORLD_SIZE_ENV = "LOCAL_WORLD_SIZE"


def ranks_per_node(world: int) -> int:
    """Ranks on one node: `LOCAL_WORLD_SIZE` when set (and it divides `world`), else the whole world."""
    raw = os.environ.get(LOCAL_WORLD_SIZE_ENV)
    if raw is None:
        return world
    try:
        local = int(raw)
    except ValueError:
        raise ValueError(f"{LOCAL_WORLD_SIZE_ENV}={raw!r} is not an integer; set it to the ranks per node") from None
    if local < 1 or world % local:
        raise ValueError(
            f"{LOCAL_WORLD_SIZE_ENV}={local} does not divide the world size {world}; every node must run the same "
            "number of ranks (set it to the ranks per node, or unset it for one node)"
        )
    return local


@dataclasses.dataclass(frozen=True)
class TwoLevel:
    """This rank's place in a group cut into blocks of `size` members."""

    size: int
    """Members per inner group."""
    count: int
    """Inner groups (blocks) in the group: members of one outer group."""
    inner: dist.ProcessGroup | None
    """This rank's block (None when `size` is 1)."""
    outer: dist.ProcessGroup | None
    """The members at this rank's position in every block (None when there is one block)."""
    inner_ranks: tuple[int, ...]
    """Global ranks of the inner group, in order."""
    outer_ranks: tuple[int, ...]
    """Global ranks of the outer group, in order."""


_BUILT: dict[tuple[int, int], TwoLevel] = {}


def two_level_groups(group: dist.ProcessGroup | None, size: int, *, what: str) -> TwoLevel:
    """Cut `group` (None: the world) into inner groups of `size` consecutive members and the outer groups
    across them. Every member of `group` must call this with the same arguments in the same order. `what`
    names the setting that asked for `size`, for the error when it does not divide the group."""
    members = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
    if size < 1 or len(members) % size:
        raise ValueError(
            f"{what}={size} does not divide the {len(members)} ranks ZeRO shards over; choose a divisor of "
            f"{len(members)} (for example the ranks per node)"
        )
    key = (id(group if group is not None else dist.group.WORLD), size)
    if key not in _BUILT:
        _BUILT[key] = _build(members, size, whole_world=len(members) == dist.get_world_size())
    return _BUILT[key]


def _build(members: list[int], size: int, *, whole_world: bool) -> TwoLevel:
    """The groups of the cut. Over the whole world every rank creates every group in the same order (new_group
    is collective over the world); over a sub-group (a data-parallel group beside tensor or sequence
    parallelism, whose other groups' ranks do not call this) each rank creates only its own block and column,
    synchronised among their members alone (`use_local_synchronization`)."""
    rank = dist.get_rank()
    count = len(members) // size
    blocks = [tuple(members[b * size : (b + 1) * size]) for b in range(count)]
    columns = [tuple(block[p] for block in blocks) for p in range(size)]
    own_block = next(block for block in blocks if rank in block)
    own_column = next(column for column in columns if rank in column)
    inner = outer = None
    for block in blocks if whole_world else [own_block]:
        made = _new_group(block, local=not whole_world) if size > 1 else None
        if block == own_block:
            inner = made
    for column in columns if whole_world else [own_column]:
        made = _new_group(column, local=not whole_world) if count > 1 else None
        if column == own_column:
            outer = made
    return TwoLevel(size, count, inner, outer, own_block, own_column)


def _new_group(ranks: tuple[int, ...], *, local: bool) -> dist.ProcessGroup:
    made: dist.ProcessGroup = dist.new_group(list(ranks), use_local_synchronization=local)
    return made

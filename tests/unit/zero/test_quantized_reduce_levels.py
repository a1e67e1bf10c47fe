"""qgZ's cut of a unit's group at node boundaries (zero/stage3/quantized_reduce.py `node_levels`) without a process
group: torch.distributed's queries answered by hand. One node, one member per node, and a group that is not the
world and needs both levels (cut by comm/nodes.py among its members)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from slipstream.comm.nodes import TwoLevel
from slipstream.zero.stage3 import quantized_reduce
from slipstream.zero.stage3.quantized_reduce import node_levels


def _world(monkeypatch: pytest.MonkeyPatch, *, world: int, rank: int, members: list[int], local: int) -> object:
    group = object()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
    monkeypatch.setattr(dist, "get_process_group_ranks", lambda g: members)
    monkeypatch.setattr(quantized_reduce, "two_level_groups", lambda *a, **k: pytest.fail("no group may be built"))
    return group


def test_a_group_inside_one_node_is_one_level(monkeypatch: pytest.MonkeyPatch) -> None:
    group = _world(monkeypatch, world=8, rank=5, members=[4, 5, 6, 7], local=4)
    assert node_levels(group) == quantized_reduce.Levels(4, 1, group, None)  # type: ignore[arg-type]


def test_a_group_with_one_member_per_node_goes_across_only(monkeypatch: pytest.MonkeyPatch) -> None:
    group = _world(monkeypatch, world=8, rank=5, members=[1, 5], local=4)
    assert node_levels(group) == quantized_reduce.Levels(1, 2, None, group)  # type: ignore[arg-type]


def test_a_sub_group_across_nodes_with_node_mates_is_cut_by_its_members(monkeypatch: pytest.MonkeyPatch) -> None:
    group = _world(monkeypatch, world=8, rank=1, members=[0, 1, 2, 3], local=2)
    asked = []

    def cut(g: object, size: int, *, what: str) -> TwoLevel:
        asked.append((g, size))
        return TwoLevel(size, 2, inner, outer, (0, 1), (1, 3))

    inner, outer = object(), object()
    monkeypatch.setattr(quantized_reduce, "two_level_groups", cut)
    assert node_levels(group) == quantized_reduce.Levels(2, 2, inner, outer)  # type: ignore[arg-type]
    assert asked == [(group, 2)]  # a MiCS shard group of 4 over 2 nodes of 2: blocks of the node-mates

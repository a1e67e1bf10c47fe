"""slipstream.comm.nodes: ranks per node from LOCAL_WORLD_SIZE, and a group cut into inner blocks and outer
columns whose collectives reach exactly the members they should (4 ranks as 2 "nodes" x 2)."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed


def node_cases(rank: int, world: int) -> dict[str, object]:
    import os

    import torch.distributed as dist

    from slipstream.comm import nodes

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    per_node = nodes.ranks_per_node(world)
    layout = nodes.two_level_groups(None, per_node, what="ranks per node")
    again = nodes.two_level_groups(None, per_node, what="ranks per node")
    inner_sum = torch.tensor([float(rank)])
    dist.all_reduce(inner_sum, group=layout.inner)
    outer_sum = torch.tensor([float(rank)])
    dist.all_reduce(outer_sum, group=layout.outer)
    return {
        "per_node": per_node,
        "inner": list(layout.inner_ranks),
        "outer": list(layout.outer_ranks),
        "inner_sum": inner_sum.item(),
        "outer_sum": outer_sum.item(),
        "cached": again is layout,
    }


def test_two_level_groups_split_four_ranks_into_nodes_and_columns(tmp_path) -> None:  # type: ignore[no-untyped-def]
    results = run_distributed(node_cases, world_size=4, tmp_dir=tmp_path, timeout_s=90)
    for rank, got in enumerate(results):
        node, position = divmod(rank, 2)
        assert got["per_node"] == 2
        assert got["inner"] == [2 * node, 2 * node + 1], (rank, got)
        assert got["outer"] == [position, position + 2], (rank, got)
        assert got["inner_sum"] == 4 * node + 1, (rank, got)  # ranks 0+1 or 2+3
        assert got["outer_sum"] == 2 * position + 2, (rank, got)  # ranks 0+2 or 1+3
        assert got["cached"] is True


def subgroup_cases(rank: int, world: int) -> dict[str, object]:
    import torch.distributed as dist

    from slipstream.comm import nodes

    evens, odds = dist.new_group([0, 2]), dist.new_group([1, 3])  # every rank creates both (collective)
    mine = evens if rank % 2 == 0 else odds
    layout = nodes.two_level_groups(mine, 1, what="size")  # only the members of `mine` call this
    total = torch.tensor([float(rank)])
    dist.all_reduce(total, group=layout.outer)
    return {"outer": list(layout.outer_ranks), "inner": list(layout.inner_ranks), "sum": total.item()}


def test_a_sub_group_is_cut_by_its_own_members_alone(tmp_path) -> None:  # type: ignore[no-untyped-def]
    results = run_distributed(subgroup_cases, world_size=4, tmp_dir=tmp_path, timeout_s=90)
    for rank, got in enumerate(results):
        parity = rank % 2
        assert got == {"outer": [parity, parity + 2], "inner": [rank], "sum": 2.0 * parity + 2}, (rank, got)


def test_ranks_per_node_refuses_a_size_that_does_not_divide_the_world(monkeypatch: pytest.MonkeyPatch) -> None:
    from slipstream.comm.nodes import ranks_per_node

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE=3 does not divide the world size 4"):
        ranks_per_node(4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert ranks_per_node(4) == 2
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert ranks_per_node(4) == 4

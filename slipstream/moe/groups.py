"""Expert-parallel and expert-data-parallel process groups (DeepSpeed's `deepspeed.utils.groups`, expert part).

[Note: expert groups]
For `ep_size` E over a world of W ranks (W a multiple of E), named "ep_size_E":
- *expert-parallel* groups are runs of E consecutive ranks, [0..E-1], [E..2E-1], ...: the ranks of one group
  together hold all the experts of a layer (rank i of the group holds experts i*L .. i*L+L-1, L = experts/E),
  and tokens travel between them by all-to-all;
- *expert-data-parallel* groups are the ranks holding the same experts, {r : r % E == i}: W/E ranks that
  reduce (and, under ZeRO, shard) those experts' gradients, parameters and optimizer state among themselves.
Every rank creates every group of a size in the same order (torch's `new_group` is collective), once per size.
Groups are made lazily, the first time a size is asked for after `torch.distributed` is initialized.

`expert_rank_layout` is the general rule (DeepSpeed's `_get_expert_parallel_ranks`), with tensor and pipeline
parallelism: ranks are numbered tensor-parallel fastest and pipeline stage slowest (stage s holds the
contiguous block s*W/P .. (s+1)*W/P-1); within a stage, the data-parallel ranks of tensor-parallel index t are
t, t+T, t+2T, ... (D = W/(T*P) of them). Those D ranks are cut into D/E expert-parallel groups of E: runs of
E consecutive ones (E + D), or with `data_before_expert` every (D/E)-th one (D + E); the ranks at the same
position of each group form an expert-data-parallel group. With T = P = 1 and E + D this is the rule above.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from slipstream.utils.expert_group_names import EXPERT_GROUP_FUNCTIONS

__all__ = ["ExpertGroups", "expert_groups", "expert_rank_layout", "group_name", *EXPERT_GROUP_FUNCTIONS]


@dataclasses.dataclass(frozen=True)
class ExpertGroups:
    """This rank's two groups for one expert-parallel size (see [Note: expert groups])."""

    name: str
    ep_size: int
    ep_group: dist.ProcessGroup | None
    """None when ep_size is 1 (no all-to-all)."""
    ep_ranks: tuple[int, ...]
    edp_group: dist.ProcessGroup | None
    """None when this rank's expert-data-parallel group is the whole world (ep_size 1): use the default group."""
    edp_ranks: tuple[int, ...]

    @property
    def ep_rank(self) -> int:
        return self.ep_ranks.index(_rank())

    @property
    def edp_size(self) -> int:
        return len(self.edp_ranks)


_GROUPS: dict[str, ExpertGroups] = {}


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def group_name(ep_size: int) -> str:
    return f"ep_size_{ep_size}"


def expert_rank_layout(
    world_size: int,
    *,
    expert_parallel_size: int,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    data_before_expert: bool = False,
) -> tuple[list[list[int]], list[list[int]]]:
    """(expert-parallel groups, expert-data-parallel groups) as rank lists (see [Note: expert groups])."""
    model = tensor_parallel_size * pipeline_parallel_size
    if min(world_size, expert_parallel_size, tensor_parallel_size, pipeline_parallel_size) < 1 or world_size % model:
        raise ValueError(
            f"world size {world_size} is not a multiple of tensor x pipeline parallel size {tensor_parallel_size} x "
            f"{pipeline_parallel_size}; every size must be positive and the model-parallel sizes must divide the world"
        )
    data = world_size // model
    if data % expert_parallel_size:
        raise ValueError(
            f"expert parallel size {expert_parallel_size} does not divide the data-parallel size {data} "
            f"(world {world_size} / tensor {tensor_parallel_size} / pipeline {pipeline_parallel_size}); choose a divisor"
        )
    stride = data // expert_parallel_size
    ep_groups: list[list[int]] = []
    edp_groups: list[list[int]] = []
    stage = world_size // pipeline_parallel_size
    for start in range(0, world_size, stage):
        for tp_index in range(tensor_parallel_size):
            ranks = [start + tp_index + k * tensor_parallel_size for k in range(data)]
            if data_before_expert:  # every stride-th data-parallel rank shares an expert-parallel group
                ranks = [ranks[k] for k in sorted(range(data), key=lambda k: (k % stride, k // stride))]
            chunks = [ranks[c : c + expert_parallel_size] for c in range(0, data, expert_parallel_size)]
            ep_groups += chunks
            edp_groups += [list(column) for column in zip(*chunks, strict=True)]
    return ep_groups, edp_groups


def expert_groups(ep_size: int) -> ExpertGroups:
    """The groups of `ep_size`, made on first use (collective: every rank must ask in the same order)."""
    name = group_name(ep_size)
    found = _GROUPS.get(name)
    if found is not None:
        return found
    world, rank = _world(), _rank()
    if ep_size < 1 or world % ep_size != 0:
        raise ValueError(
            f"MoE ep_size={ep_size} does not divide the world size {world}; choose an ep_size that divides it "
            f"(e.g. {world} or 1)"
        )
    ep_group = edp_group = None
    ep_ranks: tuple[int, ...] = (rank,)
    edp_ranks: tuple[int, ...] = tuple(range(world))
    if world > 1:
        ep_layout, edp_layout = expert_rank_layout(world, expert_parallel_size=ep_size)
        for group in ep_layout:
            made = dist.new_group(group) if ep_size > 1 else None
            if rank in group:
                ep_group, ep_ranks = made, tuple(group)
        for group in edp_layout:
            made = dist.new_group(group) if ep_size > 1 else None
            if rank in group:
                edp_group, edp_ranks = made, tuple(group)
    found = ExpertGroups(
        name=name, ep_size=ep_size, ep_group=ep_group, ep_ranks=ep_ranks, edp_group=edp_group, edp_ranks=edp_ranks
    )
    _GROUPS[name] = found
    return found


def _by_name(name: str) -> ExpertGroups:
    if name not in _GROUPS:
        if name.startswith("ep_size_") and name[8:].isdigit():
            return expert_groups(int(name[8:]))
        raise KeyError(f"no expert group named '{name}'; names look like 'ep_size_<E>' (known: {sorted(_GROUPS)})")
    return _GROUPS[name]


# ---- DeepSpeed's getters (deepspeed.utils.groups) ----
def _create_expert_and_data_parallel(
    expert_parallel_size_: int, use_data_before_expert_parallel_: bool = False
) -> None:
    if use_data_before_expert_parallel_:
        raise NotImplementedError(
            "use_data_before_expert_parallel_=True (data-parallel-major expert groups) is not implemented; "
            "leave it False"
        )
    expert_groups(expert_parallel_size_)


def _get_expert_parallel_group(group_name: str) -> dist.ProcessGroup | None:
    return _by_name(group_name).ep_group


def _get_expert_parallel_group_dict() -> dict[str, dist.ProcessGroup | None]:
    return {name: g.ep_group for name, g in _GROUPS.items()}


def _get_expert_data_parallel_group(group_name: str) -> dist.ProcessGroup | None:
    return _by_name(group_name).edp_group


def _get_expert_data_parallel_group_dict() -> dict[str, dist.ProcessGroup | None]:
    return {name: g.edp_group for name, g in _GROUPS.items()}


def _get_expert_parallel_world_size(group_name: str) -> int:
    return _by_name(group_name).ep_size


def _get_expert_parallel_rank(group_name: str) -> int:
    return _by_name(group_name).ep_rank


def _get_expert_data_parallel_world_size(group_name: str) -> int:
    return _by_name(group_name).edp_size


def _get_expert_data_parallel_rank(group_name: str) -> int:
    return _by_name(group_name).edp_ranks.index(_rank())


def _get_expert_broadcast_src_rank(group_name: str) -> int:
    return _by_name(group_name).edp_ranks[0]


def _get_max_expert_size() -> int:
    return max((g.ep_size for g in _GROUPS.values()), default=1)


def _get_max_expert_size_name() -> str:
    return group_name(_get_max_expert_size())


def _get_expert_parallel_ranks(
    world_size: int,
    tensor_parallel_size_: int,
    expert_parallel_size_: int,
    pipeline_parallel_size_: int = 1,
    use_data_before_expert_parallel_: bool = False,
) -> tuple[list[list[int]], list[list[int]]]:
    """DeepSpeed's name and parameters for `expert_rank_layout`."""
    return expert_rank_layout(
        world_size,
        expert_parallel_size=expert_parallel_size_,
        tensor_parallel_size=tensor_parallel_size_,
        pipeline_parallel_size=pipeline_parallel_size_,
        data_before_expert=use_data_before_expert_parallel_,
    )

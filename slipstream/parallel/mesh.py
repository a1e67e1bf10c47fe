"""The device mesh of one job: data x sequence x tensor parallel ranks, and their process groups.

Global rank = (data_index * sp + sequence_index) * tp + tensor_index: the ranks of a TP group are neighbours
(on GPUs, one node), then the ranks of a sequence-parallel group. ZeRO shards and reduces gradients over the
*data group*: every rank with the same tensor index (data x sequence ranks), so a sequence-parallel rank's
gradient (from its slice of the sequence) is summed with the others'. The loader reads batches by data index
only: the ranks of a TP or SP group get the same batch (the SP loader adapter then cuts the sequence).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.distributed as dist

__all__ = ["Topology", "build_topology", "current_topology"]


@dataclasses.dataclass(frozen=True)
class Topology:
    world: int
    dp: int
    sp: int
    tp: int
    rank: int
    data_group: dist.ProcessGroup | None
    """ZeRO's group: the data x sequence ranks with this rank's tensor index (None: the whole world)."""
    sp_group: dist.ProcessGroup | None
    tp_group: dist.ProcessGroup | None
    tp_mesh: Any
    """1-D DeviceMesh of this rank's TP group (None without TP)."""

    @property
    def data_index(self) -> int:
        """Which batch this rank reads (0 .. dp-1)."""
        return self.rank // (self.sp * self.tp)

    @property
    def data_group_size(self) -> int:
        return self.dp * self.sp


_BUILT: dict[tuple[Any, ...], Topology] = {}


def build_topology(*, tp: int, sp: int, device_type: str) -> Topology:
    """Groups for a TP x SP x DP job over the initialised world (every rank must call it, in the same order).
    Built once per layout and default group: a model built before `initialize` can take its sequence group
    from here (`build_topology(...).sp_group`) and the engine then uses the same groups."""
    key = (tp, sp, device_type, id(dist.group.WORLD))
    if key not in _BUILT:
        _BUILT[key] = _build(tp, sp, device_type)
    _CURRENT[:] = [_BUILT[key]]
    return _BUILT[key]


_CURRENT: list[Topology] = []


def current_topology() -> Topology | None:
    """The layout built last (by the engine or the user), for `deepspeed.utils.groups`; None without one."""
    if not _CURRENT or not (dist.is_available() and dist.is_initialized()):
        return None
    return _CURRENT[0]


def _build(tp: int, sp: int, device_type: str) -> Topology:
    world, rank = dist.get_world_size(), dist.get_rank()
    if tp < 1 or sp < 1 or world % (tp * sp):
        raise ValueError(
            f"parallel layout: world size {world} is not a multiple of tensor_parallel.autotp_size ({tp}) x "
            f"sequence_parallel_size ({sp}); launch a multiple of {tp * sp} ranks or change the sizes"
        )
    dp = world // (tp * sp)
    data_group = sp_group = tp_group = tp_mesh = None
    if tp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, (dp * sp, tp), mesh_dim_names=("data", "tp"))
        tp_mesh = mesh["tp"]
        tp_group = tp_mesh.get_group()
        data_group = mesh["data"].get_group()
    if sp > 1:
        for d in range(dp):
            for t in range(tp):
                members = [(d * sp + s) * tp + t for s in range(sp)]
                group = dist.new_group(members)
                if rank in members:
                    sp_group = group
    return Topology(world, dp, sp, tp, rank, data_group, sp_group, tp_group, tp_mesh)

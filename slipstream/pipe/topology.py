"""Process topology for pipeline x data parallelism: DeepSpeed's `ProcessTopology`, `PipeDataParallelTopology`
and `PipelineParallelGrid`.

Ranks are laid out with the last axis fastest (DeepSpeed's order): with axes ("pipe", "data") and 2 x 2
ranks, stage 0 holds global ranks 0 and 1, stage 1 holds 2 and 3. The grid creates, on every rank and in the
same order, one process group per data-parallel replica set of a stage (ZeRO runs inside it) and one per
pipeline (the ranks of one data-parallel index across the stages).
"""

from __future__ import annotations

import collections
import itertools
from typing import Any

import torch.distributed as dist

_GROUPS: dict[tuple[int, tuple[int, ...]], tuple[Any, Any]] = {}


def group_of(ranks: list[int]) -> Any:
    """The process group of `ranks` (WORLD when that is every rank), created once per default group and kept:
    every rank asks for every group in the same order, so the caches agree and new_group is called in step."""
    if len(ranks) == dist.get_world_size():
        return dist.group.WORLD
    world = dist.group.WORLD
    key = (id(world), tuple(ranks))  # the entry keeps `world` alive, so its id is not reused while cached
    if key not in _GROUPS:
        _GROUPS[key] = (world, dist.new_group(list(ranks)))
    return _GROUPS[key][1]


class ProcessTopology:
    """Maps n-dimensional coordinates (one per axis) to linear ranks and back."""

    def __init__(self, axes: list[str], dims: list[int]) -> None:
        if len(axes) != len(dims) or any(d < 1 for d in dims):
            raise ValueError(f"ProcessTopology: axes {axes} and dims {dims} must have the same length, dims >= 1")
        self.axes, self.dims = list(axes), list(dims)
        self.ProcessCoord = collections.namedtuple("ProcessCoord", self.axes)  # type: ignore[misc]
        self.mapping: dict[Any, int] = {}
        for rank, coord in enumerate(itertools.product(*[range(d) for d in self.dims])):
            self.mapping[self.ProcessCoord(*coord)] = rank  # type: ignore[arg-type]

    def get_rank(self, **coord_kwargs: int) -> int:
        if sorted(coord_kwargs) != sorted(self.axes):
            raise ValueError(f"get_rank() needs one coordinate per axis {self.axes}; got {sorted(coord_kwargs)}")
        key = self.ProcessCoord(**coord_kwargs)
        if key not in self.mapping:
            raise ValueError(f"coordinate {coord_kwargs} is outside the topology {dict(zip(self.axes, self.dims))}")
        return self.mapping[key]

    def get_coord(self, rank: int) -> Any:
        for coord, r in self.mapping.items():
            if r == rank:
                return coord
        raise ValueError(f"rank {rank} is not in the topology of {self.world_size()} ranks")

    def get_axis_names(self) -> list[str]:
        return list(self.axes)

    def get_dim(self, axis: str) -> int:
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def world_size(self) -> int:
        size = 1
        for d in self.dims:
            size *= d
        return size

    def get_rank_repr(
        self, rank: int, omit_axes: tuple[str, ...] = ("data", "pipe"), inner_sep: str = "_", outer_sep: str = "-"
    ) -> str:
        coord = self.get_coord(rank)
        return outer_sep.join(f"{a}{inner_sep}{getattr(coord, a):02d}" for a in self.axes if a not in omit_axes)

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """The ranks whose coordinate on `axis` is `idx`."""
        return sorted(r for c, r in self.mapping.items() if getattr(c, axis) == idx)

    def filter_match(self, **filter_kwargs: int) -> list[int]:
        return sorted(r for c, r in self.mapping.items() if all(getattr(c, k) == v for k, v in filter_kwargs.items()))

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """For each fixed value of the other axes, the ranks along `axis` (the groups that communicate on it)."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for fixed in itertools.product(*[range(self.get_dim(a)) for a in others]):
            keys = dict(zip(others, fixed))
            lists.append([self.get_rank(**keys, **{axis: i}) for i in range(self.get_dim(axis))])
        return lists


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline x data parallelism; data is the fastest axis, so a stage's replicas are neighbouring ranks."""

    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline x data x tensor (model) parallelism, DeepSpeed's axis order: tensor ranks are neighbours, then
    data-parallel replicas, then pipeline stages. `PipelineParallelGrid` builds only the pipe and data groups;
    tensor parallelism is planned separately (parallel/tensor.py)."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


class PipelineParallelGrid:
    """The process groups of a `PipeDataParallelTopology` and this rank's place in it."""

    def __init__(self, topology: ProcessTopology | None = None, process_group: dist.ProcessGroup | None = None) -> None:
        self.global_rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if topology is None:
            topology = PipeDataParallelTopology(num_pp=1, num_dp=self.world_size)
        if topology.world_size() != self.world_size:
            raise ValueError(
                f"the pipeline topology has {topology.world_size()} ranks "
                f"({dict(zip(topology.axes, topology.dims))}) but the job has {self.world_size}; "
                "make pipe x data equal the world size"
            )
        self._topo = topology
        self.pipe_parallel_size = max(topology.get_dim("pipe"), 1)
        self.data_parallel_size = max(topology.get_dim("data"), 1)
        coord = topology.get_coord(self.global_rank)
        self.stage_id = getattr(coord, "pipe", 0)
        self.data_parallel_id = getattr(coord, "data", 0)
        self.dp_group: Any = None
        self.pp_group: Any = None
        for ranks in topology.get_axis_comm_lists("data") or [[r] for r in range(self.world_size)]:
            group = group_of(ranks)
            if self.global_rank in ranks:
                self.dp_group, self.dp_ranks = group, ranks
        for ranks in topology.get_axis_comm_lists("pipe") or [[r] for r in range(self.world_size)]:
            group = group_of(ranks)
            if self.global_rank in ranks:
                self.pp_group, self.pipe_ranks = group, ranks

    # ---- DeepSpeed's getters ----
    def get_stage_id(self) -> int:
        return self.stage_id

    def get_data_parallel_id(self) -> int:
        return self.data_parallel_id

    def get_pipe_parallel_rank(self) -> int:
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self) -> Any:
        return self.pp_group

    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_group(self) -> Any:
        return self.dp_group

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_global_rank(self) -> int:
        return self.global_rank

    def stage_to_global(self, stage_id: int, **kwargs: int) -> int:
        """Global rank of `stage_id` in this rank's pipeline (same data-parallel index unless given)."""
        coord = self._topo.get_coord(self.global_rank)._asdict()
        coord.update(pipe=stage_id, **kwargs)
        return self._topo.get_rank(**coord)

    @property
    def topology(self) -> ProcessTopology:
        return self._topo

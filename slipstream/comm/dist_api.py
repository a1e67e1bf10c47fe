"""DeepSpeed's `deepspeed.comm` functions (torch.distributed's signatures), on Slipstream's collectives.

Every collective here goes through `collectives._issue`: it is counted, numbered, given a deadline and
names the ranks that did not arrive (docs/design.md D13), like the collectives ZeRO issues. Functions that
are several collectives inside torch (`broadcast_object_list`, `all_gather_object`) and point-to-point
operations (`send`, `recv`, ...; only two ranks take part, so they carry no world-wide sequence number) call
torch.distributed directly and are bounded by the process group's own timeout, which is the same deadline.
`async_op=True` returns a work whose `wait()` raises `CollectiveTimeout` / `PeerLost` instead of hanging.

Slipstream trains data-parallel over the whole world, so groups are torch.distributed's groups. DeepSpeed's
communication logger (`configure`, `log_summary`) and its cloud helpers (`mpi_discovery`, the AzureML /
SageMaker patches) are not implemented: they raise NotImplementedError naming the function.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from slipstream.comm.collectives import TimedWork, _issue
from slipstream.comm.init import init_distributed, is_initialized
from slipstream.utils.deprecation import warn_deprecated

__all__ = [
    "ReduceOp",
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "allgather_fn",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "configure",
    "destroy_process_group",
    "enable_symm_mem_for_group",
    "gather",
    "get_all_ranks_from_group",
    "get_comm_operation_count",
    "get_global_rank",
    "get_local_rank_from_launcher",
    "get_logged_comm_ops",
    "get_world_rank_from_launcher",
    "get_world_size_from_launcher",
    "has_comm_data",
    "init_deepspeed_backend",
    "reset_log",
    "set_backend",
    "get_local_rank",
    "get_rank",
    "get_world_group",
    "get_world_size",
    "has_all_gather_into_tensor",
    "has_all_reduce_coalesced",
    "has_coalescing_manager",
    "has_reduce_scatter_tensor",
    "in_aml",
    "in_aws_sm",
    "in_dlts",
    "inference_all_reduce",
    "init_distributed",
    "initialize_mesh_device",
    "irecv",
    "is_available",
    "is_initialized",
    "isend",
    "log_summary",
    "monitored_barrier",
    "mpi_discovery",
    "new_group",
    "patch_aml_env_for_torch_nccl_backend",
    "patch_aws_sm_env_for_torch_nccl_backend",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_fn",
    "reduce_scatter_tensor",
    "scatter",
    "send",
    "timed_op",
]

ReduceOp = dist.ReduceOp
_F = TypeVar("_F", bound=Callable[..., object])
_SUM = dist.ReduceOp.SUM
_Group = ProcessGroup | None  # a torch.distributed group; None is the whole world
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _result(work: TimedWork, async_op: bool) -> TimedWork | None:
    return work if async_op else None


# ---- process groups and ranks ----
def is_available() -> bool:
    return dist.is_available()


def destroy_process_group(group: _Group = None) -> None:
    dist.destroy_process_group(group)


def new_group(ranks: list[int]) -> Any:
    return dist.new_group(ranks)


def get_world_group() -> Any:
    return dist.group.WORLD


def get_rank(group: _Group = None) -> int:
    return dist.get_rank(group) if is_initialized() else int(os.environ.get("RANK", "0"))


def get_world_size(group: _Group = None) -> int:
    return dist.get_world_size(group) if is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def get_local_rank() -> int:
    """This process's rank on its node (the launcher's LOCAL_RANK; 0 without a launcher)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_global_rank(group: _Group = None, group_rank: int = 0) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def get_all_ranks_from_group(group: _Group = None) -> list[int]:
    return list(range(get_world_size())) if group is None else dist.get_process_group_ranks(group)


# ---- collectives (counted, numbered, with deadlines) ----
def all_reduce(
    tensor: torch.Tensor, op: ReduceOp.RedOpType = _SUM, group: _Group = None, async_op: bool = False, **_: object
) -> TimedWork | None:
    launch = lambda t: dist.all_reduce(t, op=op, group=group, async_op=True)  # noqa: E731
    return _result(_issue("all_reduce", tensor, (tensor,), launch, async_op), async_op)


inference_all_reduce = all_reduce


def all_reduce_coalesced(
    tensors: list[torch.Tensor], op: ReduceOp.RedOpType = _SUM, group: _Group = None, async_op: bool = False
) -> Any:
    """One all-reduce over the tensors packed together; each tensor gets its part back."""
    flat = torch.cat([t.reshape(-1) for t in tensors])

    def unpack() -> None:
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

    launch = lambda f: dist.all_reduce(f, op=op, group=group, async_op=True)  # noqa: E731
    return _result(_issue("all_reduce", flat, (flat,), launch, async_op, finish=unpack), async_op)


def broadcast(
    tensor: torch.Tensor, src: int, group: _Group = None, async_op: bool = False, **_: object
) -> TimedWork | None:
    launch = lambda t: dist.broadcast(t, src=src, group=group, async_op=True)  # noqa: E731
    return _result(_issue("broadcast", tensor, (tensor,), launch, async_op), async_op)


def all_gather_into_tensor(
    output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: _Group = None, async_op: bool = False, **_: object
) -> TimedWork | None:
    launch = lambda o, i: _all_gather_flat(o, i, group=group, async_op=True)  # noqa: E731
    return _result(_issue("all_gather", output_tensor, (output_tensor, input_tensor), launch, async_op), async_op)


allgather_fn = all_gather_into_tensor


def all_gather(
    tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: _Group = None, async_op: bool = False, **_: object
) -> TimedWork | None:
    """Every rank's `tensor` into `tensor_list[rank]` (one flat all-gather, then copied out).

    Slipstream 0.1's form, a flat output tensor first, still works (deprecated: all_gather_into_tensor)."""
    if isinstance(tensor_list, torch.Tensor):
        warn_deprecated("slipstream.comm.all_gather(flat_output, input)", "all_gather_into_tensor", since="0.2")
        launch_flat = lambda o, i: _all_gather_flat(o, i, group=group, async_op=True)  # noqa: E731
        return _issue("all_gather", tensor_list, (tensor_list, tensor), launch_flat, async_op)
    flat = torch.empty(len(tensor_list) * tensor.numel(), dtype=tensor.dtype, device=tensor.device)

    def unpack() -> None:
        for out, part in zip(tensor_list, flat.chunk(len(tensor_list)), strict=True):
            out.copy_(part.view_as(out))

    launch = lambda o, i: _all_gather_flat(o, i, group=group, async_op=True)  # noqa: E731
    work = _issue("all_gather", flat, (flat, tensor.reshape(-1).contiguous()), launch, async_op, finish=unpack)
    return _result(work, async_op)


def all_gather_coalesced(
    output_tensors: list[list[torch.Tensor]],
    input_tensors: list[torch.Tensor],
    group: _Group = None,
    async_op: bool = False,
) -> Any:
    for outputs, tensor in zip(output_tensors, input_tensors, strict=True):
        all_gather(outputs, tensor, group=group)
    return None


def reduce_scatter_tensor(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    op: ReduceOp.RedOpType = _SUM,
    group: _Group = None,
    async_op: bool = False,
    **_: object,
) -> TimedWork | None:
    """Reduce `input_tensor` (world x output's elements) across ranks; rank r keeps chunk r. On the host this
    is an all-reduce and a copy of the chunk, as gloo itself does (see collectives.reduce_scatter)."""
    if input_tensor.device.type != "cpu":
        launch = lambda i, o: _reduce_scatter_flat(o, i, op=op, group=group, async_op=True)  # noqa: E731
        work = _issue("reduce_scatter", input_tensor, (input_tensor, output_tensor), launch, async_op)
        return _result(work, async_op)
    summed = input_tensor.clone()
    chunk = summed.reshape(-1).chunk(dist.get_world_size(group))[dist.get_rank(group)]
    finish = lambda: output_tensor.view(-1).copy_(chunk)  # noqa: E731
    on_host = lambda t: dist.all_reduce(t, op=op, group=group, async_op=True)  # noqa: E731
    return _result(_issue("reduce_scatter", input_tensor, (summed,), on_host, async_op, finish=finish), async_op)


reduce_scatter_fn = reduce_scatter_tensor


def reduce_scatter(
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    op: ReduceOp.RedOpType = _SUM,
    group: _Group = None,
    async_op: bool = False,
    **_: object,
) -> TimedWork | None:
    """Reduce the concatenation of `input_list` across ranks; rank r keeps part r in `output`.

    Slipstream 0.1's form, a flat input tensor, still works (deprecated: reduce_scatter_tensor)."""
    if isinstance(input_list, torch.Tensor):
        warn_deprecated("slipstream.comm.reduce_scatter(output, flat_input)", "reduce_scatter_tensor", since="0.2")
        from slipstream.comm import collectives

        return collectives.reduce_scatter(output, input_list, group=group, async_op=async_op)
    return reduce_scatter_tensor(output, torch.cat([t.reshape(-1) for t in input_list]), op, group, async_op)


def reduce(
    tensor: torch.Tensor,
    dst: int,
    op: ReduceOp.RedOpType = _SUM,
    group: _Group = None,
    async_op: bool = False,
    **_: object,
) -> TimedWork | None:
    launch = lambda t: dist.reduce(t, dst=dst, op=op, group=group, async_op=True)  # noqa: E731
    return _result(_issue("reduce", tensor, (tensor,), launch, async_op), async_op)


def gather(
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None = None,
    dst: int = 0,
    group: _Group = None,
    async_op: bool = False,
    **_: object,
) -> TimedWork | None:
    launch = lambda t: dist.gather(t, gather_list, dst=dst, group=group, async_op=True)  # noqa: E731
    return _result(_issue("gather", tensor, (tensor,), launch, async_op), async_op)


def scatter(
    tensor: torch.Tensor,
    scatter_list: list[torch.Tensor] | None = None,
    src: int = 0,
    group: _Group = None,
    async_op: bool = False,
    **_: object,
) -> TimedWork | None:
    launch = lambda t: dist.scatter(t, scatter_list, src=src, group=group, async_op=True)  # noqa: E731
    return _result(_issue("scatter", tensor, (tensor,), launch, async_op), async_op)


def all_to_all_single(
    output: torch.Tensor,
    tensor: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: _Group = None,
    async_op: bool = False,
    **_: object,
) -> TimedWork | None:
    def launch(o: torch.Tensor, i: torch.Tensor) -> Any:
        return dist.all_to_all_single(o, i, output_split_sizes, input_split_sizes, group=group, async_op=True)

    return _result(_issue("all_to_all", output, (output, tensor), launch, async_op), async_op)


def all_to_all(
    output_tensor_list: list[torch.Tensor],
    input_tensor_list: list[torch.Tensor],
    group: _Group = None,
    async_op: bool = False,
) -> Any:
    return dist.all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=async_op)


def barrier(
    group: _Group = None, async_op: bool = False, device_ids: list[int] | None = None, **_: object
) -> TimedWork | None:
    nothing = torch.empty(0)
    launch = lambda _t: dist.barrier(group=group, async_op=True)  # noqa: E731
    return _result(_issue("barrier", nothing, (nothing,), launch, async_op), async_op)


def monitored_barrier(
    group: _Group = None, timeout: timedelta | None = None, wait_all_ranks: bool = False, **_: object
) -> None:
    dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


# ---- several collectives inside torch, and point to point: the group's own timeout bounds them ----
def broadcast_object_list(
    object_list: list[object], src: int, group: _Group = None, device: torch.device | None = None
) -> None:
    dist.broadcast_object_list(object_list, src=src, group=group, device=device)


def all_gather_object(object_list: list[object], obj: object, group: _Group = None, **_: object) -> None:
    dist.all_gather_object(object_list, obj, group=group)


def send(tensor: torch.Tensor, dst: int, group: _Group = None, tag: int = 0, **_: object) -> None:
    dist.send(tensor, dst, group=group, tag=tag)


def recv(tensor: torch.Tensor, src: int | None = None, group: _Group = None, tag: int = 0, **_: object) -> int:
    return dist.recv(tensor, src, group=group, tag=tag)


def isend(tensor: torch.Tensor, dst: int, group: _Group = None, tag: int = 0, **_: object) -> Any:
    return dist.isend(tensor, dst, group=group, tag=tag)


def irecv(tensor: torch.Tensor, src: int | None = None, group: _Group = None, tag: int = 0, **_: object) -> Any:
    return dist.irecv(tensor, src, group=group, tag=tag)


# ---- capability probes (DeepSpeed asks the backend) ----
def has_all_gather_into_tensor() -> bool:
    return True


def has_reduce_scatter_tensor() -> bool:
    return True


def has_all_reduce_coalesced() -> bool:
    return True


def has_coalescing_manager() -> bool:
    return False


# ---- environment probes ----
def in_aml() -> bool:
    return "AZUREML_EXPERIMENT_ID" in os.environ


def in_aws_sm() -> bool:
    return "SM_TRAINING_ENV" in os.environ


def in_dlts() -> bool:
    return "DLTS_JOB_ID" in os.environ


def get_local_rank_from_launcher() -> int:
    return int(os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")))


def get_world_rank_from_launcher() -> int:
    return int(os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))


def get_world_size_from_launcher() -> int:
    return int(os.environ.get("WORLD_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1")))


def timed_op(func: _F) -> _F:
    """DeepSpeed's timing decorator: collectives here are counted by `count_collectives`; returns `func`."""
    return func


def _not_implemented(name: str, why: str) -> Callable[..., Any]:
    def refuse(*args: object, **kwargs: object) -> NoReturn:
        raise NotImplementedError(f"slipstream.comm.{name} is not implemented: {why}")

    refuse.__name__ = name
    return refuse


_LOGGER = (
    "DeepSpeed's communication logger is not implemented; count collectives with slipstream.comm.count_collectives"
)
configure = _not_implemented("configure", _LOGGER)
log_summary = _not_implemented("log_summary", _LOGGER)
reset_log = _not_implemented("reset_log", _LOGGER)
has_comm_data = _not_implemented("has_comm_data", _LOGGER)
get_comm_operation_count = _not_implemented("get_comm_operation_count", _LOGGER)
get_logged_comm_ops = _not_implemented("get_logged_comm_ops", _LOGGER)
set_backend = _not_implemented("set_backend", "the backend is chosen by init_distributed(dist_backend=...)")
init_deepspeed_backend = _not_implemented("init_deepspeed_backend", "DeepSpeed's own backends (ccl, hccl) are not used")
mpi_discovery = _not_implemented("mpi_discovery", "start MPI jobs with `slipstream run --launcher openmpi`")
patch_aml_env_for_torch_nccl_backend = _not_implemented(
    "patch_aml_env_for_torch_nccl_backend", "set MASTER_ADDR/MASTER_PORT yourself"
)
patch_aws_sm_env_for_torch_nccl_backend = _not_implemented(
    "patch_aws_sm_env_for_torch_nccl_backend", "set MASTER_ADDR/MASTER_PORT yourself"
)
initialize_mesh_device = _not_implemented(
    "initialize_mesh_device", "device meshes (tensor/sequence parallel) are not part of the data-parallel engine"
)
enable_symm_mem_for_group = _not_implemented("enable_symm_mem_for_group", "symmetric memory is not used")

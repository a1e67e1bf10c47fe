"""What a rank saves and loads: its `OwnedSlice`s (zero/slices.py), buffers, RNG, and the JSON conversions.

`EngineParts` is the engine seen by the checkpoint code: the module, the ZeRO optimizer (or None), the
stage-3 ZeroModel (or None) and the parameter names. `collect_slices` returns this rank's slices of every
parameter: trainable ones from the optimizer (with their master and optimizer-state views), the others
(frozen parameters, or all of them without an optimizer) from the shards at stage 3, or whole on rank 0
(for a save) / every rank (for a load) at stages 0-2.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from slipstream.checkpoint.errors import CheckpointError
from slipstream.checkpoint.source import TensorSource, WrapsOptimizer
from slipstream.zero.slices import OwnedSlice


@dataclasses.dataclass
class EngineParts:
    module: nn.Module
    optimizer: Any
    """The ZeroOptimizer (stages 0-3), or None for an inference-only engine."""
    zero_model: Any
    names: dict[int, str]
    rank: int
    world_size: int
    stage: int
    tp_layouts: dict[str, Any] | None = None
    """Tensor parallelism: parameter name -> tp_slices.TpLayout (checkpoints hold global tensors)."""
    tp_rank: int = 0
    held_elsewhere: frozenset[str] = frozenset()
    """Names of parameters of the model that other ranks hold and this one does not (MoE experts of other
    expert-parallel ranks): present in a checkpoint, not expected here."""


def trainable_names(parts: EngineParts) -> set[str]:
    if parts.optimizer is None:
        return set()
    return {parts.names[id(p)] for p in parts.optimizer.trainable_params()}


def collect_slices(parts: EngineParts, *, for_save: bool) -> list[OwnedSlice]:
    slices = _local_slices(parts, for_save=for_save)
    if parts.tp_layouts is None:
        return slices
    from slipstream.checkpoint.tp_slices import to_global

    return to_global(slices, parts.tp_layouts, tp_rank=parts.tp_rank, for_save=for_save)


def global_shape(parts: EngineParts, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The checkpoint's shape of parameter `name` (its TP-global shape under tensor parallelism)."""
    layout = (parts.tp_layouts or {}).get(name)
    return shape if layout is None else tuple(layout.global_shape)


def _local_slices(parts: EngineParts, *, for_save: bool) -> list[OwnedSlice]:
    slices: list[OwnedSlice] = []
    if for_save and parts.zero_model is not None and parts.zero_model.sharding.replica_index:
        return slices  # MiCS: the first shard group writes the shards, the others hold the same ones
    if parts.optimizer is not None:
        slices.extend(parts.optimizer.owned_slices(parts.names, for_save=for_save))
    skip = trainable_names(parts)
    if parts.zero_model is not None:
        slices.extend(parts.zero_model.value_slices(parts.names, skip=skip))
        return slices
    if for_save and parts.rank != 0:
        return slices
    for local_name, param in parts.module.named_parameters():
        name = parts.names.get(id(param), local_name)  # MoE experts: by global expert index
        if name not in skip and param.numel() > 0:
            slices.append(OwnedSlice(name=name, shape=tuple(param.shape), lo=0, hi=param.numel(), value=param.data))
    return slices


def flat_state_keys(optimizer: WrapsOptimizer, piece: torch.Tensor) -> list[str]:
    """The state entries of `piece` shaped like it (exp_avg, exp_avg_sq, momentum_buffer, ...)."""
    state = optimizer.optimizer.state.get(piece, {})
    return sorted(
        k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == piece.numel()
    )


def scalar_state(optimizer: WrapsOptimizer) -> list[dict[str, Any]]:
    """Per param group: the state values that are not per-element (Adam's step), from its first piece."""
    out: list[dict[str, Any]] = []
    for group in optimizer.optimizer.param_groups:
        values: dict[str, Any] = {}
        for piece in group["params"]:
            state = optimizer.optimizer.state.get(piece)
            if state:
                values = {
                    k: to_json(v, f"optimizer state {k!r}")
                    for k, v in state.items()
                    if not (isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == piece.numel())
                }
                break
        out.append(values)
    return out


def hyperparameters(optimizer: WrapsOptimizer) -> list[dict[str, Any]]:
    """Each param group's values but its parameters and the tensors an optimizer keeps itself among its rank
    tensors (its `tensor_group_keys`, such as the 1-bit optimizers' `exp_avg_mask`)."""
    own: tuple[str, ...] = getattr(optimizer.optimizer, "tensor_group_keys", ())
    return [
        {k: to_json(v, f"param group {k!r}") for k, v in group.items() if k != "params" and k not in own}
        for group in optimizer.optimizer.param_groups
    ]


def to_json(value: object, what: str) -> Any:
    """A JSON-storable copy of `value` (tensors of one element become numbers, tuples lists)."""
    if isinstance(value, torch.Tensor):
        if value.numel() == 1:
            return value.item()
        raise CheckpointError(f"{what} is a tensor of shape {tuple(value.shape)}; only scalars go into the manifest")
    if isinstance(value, float) and not math.isfinite(value):
        return value
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [to_json(v, what) for v in value]
    if isinstance(value, dict):
        return {str(k): to_json(v, f"{what}[{k!r}]") for k, v in value.items()}
    raise CheckpointError(
        f"{what} is a {type(value).__name__}, which a checkpoint cannot store; use JSON values "
        "(numbers, strings, lists, dicts) or tensors"
    )


def shared_parameter_names(module: nn.Module) -> dict[str, str]:
    """Tied parameters: {every later name of a parameter: its first name}. A checkpoint stores a tied
    parameter once, under its first name (`named_parameters()`'s); this records the others, so readers that
    rebuild a full state dict (`get_fp32_state_dict_from_zero_checkpoint`) can give it every name."""
    first: dict[int, str] = {}
    shared: dict[str, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        owner = first.setdefault(id(param), name)
        if owner != name:
            shared[name] = owner
    return shared


def split_client_state(client_state: Mapping[str, object]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """client_state as (JSON values, top-level tensors); anything else is an error naming the key."""
    values: dict[str, Any] = {}
    tensors: dict[str, torch.Tensor] = {}
    for key, value in (client_state or {}).items():
        if isinstance(value, torch.Tensor):
            tensors[str(key)] = value.detach().to("cpu").contiguous()
        else:
            try:
                values[str(key)] = to_json(value, f"client_state[{key!r}]")
            except CheckpointError as exc:
                raise CheckpointError(f"save_checkpoint: {exc}") from None
    return values, tensors


def optimizer_rank_tensors(parts: EngineParts) -> dict[str, torch.Tensor]:
    """Tensors the wrapped optimizer keeps for this rank alone (`rank_tensors()`, the 1-bit optimizers' errors),
    saved as `optimizer_rank/<rank>/<name>`; {} for other optimizers."""
    own = getattr(parts.optimizer.optimizer, "rank_tensors", None) if parts.optimizer is not None else None
    return own() if callable(own) else {}


def restore_optimizer_rank_tensors(parts: EngineParts, source: TensorSource, saved_world_size: int) -> None:
    """Hand the optimizer this rank's saved `optimizer_rank/<rank>/*` tensors (it decides what to keep at another
    world size), when it takes them."""
    take = getattr(parts.optimizer.optimizer, "load_rank_tensors", None) if parts.optimizer is not None else None
    if not callable(take):
        return
    prefix = f"optimizer_rank/{parts.rank}/"
    found = {key[len(prefix) :]: source.read(key) for key in source.keys() if key.startswith(prefix)}
    take(found, saved_world_size=saved_world_size)


def rng_tensors() -> dict[str, torch.Tensor]:
    from slipstream.accelerator import get_accelerator

    states = {"cpu": torch.get_rng_state()}
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        try:
            states["accelerator"] = accelerator.get_rng_state().cpu()
        except (AttributeError, RuntimeError):
            pass
    return states


def restore_rng(states: dict[str, torch.Tensor]) -> None:
    from slipstream.accelerator import get_accelerator

    if "cpu" in states:
        torch.set_rng_state(states["cpu"].to(torch.uint8))
    if "accelerator" in states and get_accelerator().device_name() != "cpu":
        get_accelerator().set_rng_state(states["accelerator"].to(torch.uint8))

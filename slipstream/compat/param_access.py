"""DeepSpeed's `safe_get_*` / `safe_set_*` helpers: one parameter's fp32 master values and optimizer state,
whole or this rank's part, whatever the ZeRO stage.

They read and write through the optimizer's `owned_slices` (zero/slices.py), the same view checkpoints use,
so they never depend on a stage's layout. The `full` variants are collective (every rank calls them, as in
DeepSpeed): each rank fills its own disjoint part and one all-reduce assembles the tensor. A setter writes
the master values and then publishes them to the model's parameters on every rank. A parameter that no
engine trains gives None, as in DeepSpeed. Engines are found through `register_engine` (the engine's
DeepSpeed-method mixin registers itself, weakly).

Gradients (`safe_get_full_grad`, `safe_get_local_grad`, the `*_grad` setters, `safe_update_full_grad_vectorized`)
are read and written between the last backward of a step and `engine.step()`. Slipstream sums gradients into
flat storage and averages them once, at the step (docs/design.md D7), so the first accessor call of a step
finishes the reduction early (`settle_gradients()`: collective, every rank calls the accessors, as in
DeepSpeed) and the step then skips it. A getter returns the averaged gradient the step will use (summed over
ranks and micro-batches, divided by ranks x micro-batches x the fp16 loss scale), before clipping, in the
gradient accumulation dtype; a setter stores `value` times that divisor, so the step uses exactly `value`.
Outside that window (in the middle of an accumulation window) they raise RuntimeError: at stages 0 and 1 the
early reduction would count the later micro-batches' gradients wrongly. At ZeRO-3 with NVMe offload the
gradients live in files one sub-group at a time; each call reads in the sub-groups holding its parameter
(`gradients_resident`) and a setter writes them back and re-measures their norms.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = [
    "register_engine",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "safe_update_full_grad_vectorized",
]

_ENGINES: weakref.WeakSet[Any] = weakref.WeakSet()


def register_engine(engine: Any) -> None:
    _ENGINES.add(engine)


def _engine_of(param: torch.Tensor) -> tuple[Any, Any, str] | None:
    """(engine, its ZeRO optimizer, the parameter's name) of the engine that trains `param`."""
    for engine in list(_ENGINES):
        optimizer: Any = getattr(engine, "optimizer", None)
        names = getattr(optimizer, "param_names", None)
        if names and id(param) in names and any(p is param for p in optimizer.trainable_params()):
            return engine, optimizer, names[id(param)]
    return None


def _owner(param: torch.Tensor) -> tuple[Any, str] | None:
    found = _engine_of(param)
    return None if found is None else (found[1], found[2])


def _in_memory(param: torch.Tensor) -> contextlib.AbstractContextManager[Any]:
    """The engine's NVMe-offloaded parameter shards, masters and optimizer states in memory for the block (the
    slices the accessors read and write are views of them); nothing to do without NVMe offload. The whole
    model's state is brought in, as for a checkpoint: these accessors are for inspection, not for a hot loop."""
    found = _engine_of(param)
    resident = getattr(found[0], "_resident", None) if found is not None else None
    return resident() if resident is not None else contextlib.nullcontext()


def _slices(optimizer: Any, name: str, *, disjoint: bool = True) -> list[Any]:
    """`name`'s slices on this rank; `disjoint`: at stage 0 (every rank holds everything) only this rank's
    share, so the ranks' parts add up to the whole once."""
    return optimizer.owned_slices(optimizer.param_names, for_save=disjoint, only=name)


def _state(optimizer: Any, piece: torch.Tensor, key: str) -> dict[str, torch.Tensor]:
    state = optimizer.optimizer.state.get(piece)
    if not state or key not in state:
        known = sorted(state) if state else []
        raise KeyError(
            f"optimizer state {key!r} does not exist (the optimizer keeps {known}; before the first step it keeps none)"
        )
    return state


def _full(param: torch.Tensor, read: Any) -> torch.Tensor | None:
    found = _owner(param)
    if found is None:
        return None
    optimizer, name = found
    numel = param.ds_numel if hasattr(param, "ds_numel") else param.numel()
    shape = tuple(param.ds_shape) if hasattr(param, "ds_shape") else tuple(param.shape)
    with _in_memory(param):
        slices = _slices(optimizer, name)
        device = slices[0].value.device if slices else param.device
        full = torch.zeros(numel, dtype=torch.float32, device=device)
        for piece in slices:
            full[piece.lo : piece.hi] = read(optimizer, piece).float()
    _assemble(optimizer, param, full)
    return full.view(shape)


def _assemble(optimizer: Any, param: torch.Tensor, full: torch.Tensor) -> None:
    """Sum the ranks' disjoint parts of `full` over the process group `param` is sharded over: its param group's or
    its unit's (MoE experts: their expert-data-parallel group), else the optimizer's data-parallel group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    location = getattr(optimizer, "_param_location", {}).get(id(param))  # stages 0-2
    record = getattr(param, "ds_record", None)  # stage 3: the unit's group
    if location is not None:
        group = location[0].process_group
    else:
        group = record.unit.group if record is not None else optimizer.process_group
    if dist.get_world_size(group) > 1:
        from slipstream.comm import collectives

        collectives.all_reduce(full, group=group)


def _local(param: torch.Tensor, read: Any) -> torch.Tensor | None:
    found = _owner(param)
    if found is None:
        return None
    optimizer, name = found
    with _in_memory(param):
        pieces = [read(optimizer, piece).float() for piece in _slices(optimizer, name)]
        return torch.cat(pieces) if pieces else torch.empty(0)


def _master(optimizer: Any, piece: Any) -> torch.Tensor:
    return piece.master if piece.master is not None else piece.value


def _set(param: torch.Tensor, value: torch.Tensor, write: Any, *, full: bool) -> None:
    found = _owner(param)
    if found is None:
        raise ValueError("this parameter is not trained by any Slipstream engine; pass one of engine.parameters()")
    optimizer, name = found
    flat = value.detach().reshape(-1)
    offset = 0
    with _in_memory(param):
        for piece in _slices(optimizer, name):
            part = flat[piece.lo : piece.hi] if full else flat[offset : offset + piece.numel]
            offset += piece.numel
            write(optimizer, piece, part)
        optimizer.publish_loaded()


def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """The whole fp32 master of `param`, in its global shape (collective)."""
    return _full(param, _master)


def safe_get_local_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's part of `param`'s fp32 master, flat."""
    return _local(param, _master)


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """The whole optimizer state `optim_state_key` ("exp_avg", ...) of `param` (collective)."""
    return _full(param, lambda opt, s: s.state_view(_state(opt, s.piece, optim_state_key), optim_state_key))


def safe_get_local_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    return _local(param, lambda opt, s: s.state_view(_state(opt, s.piece, optim_state_key), optim_state_key))


def _write_master(optimizer: Any, piece: Any, part: torch.Tensor) -> None:
    _master(optimizer, piece).copy_(part)


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set `param`'s fp32 master (and so the parameter) to `value`, the whole tensor (collective)."""
    _set(param, value, _write_master, full=True)


def safe_set_local_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set this rank's part of `param`'s fp32 master to `value` (what safe_get_local_fp32_param returned)."""
    _set(param, value, _write_master, full=False)


def _state_writer(key: str) -> Any:
    def write(optimizer: Any, piece: Any, part: torch.Tensor) -> None:
        piece.state_view(_state(optimizer, piece.piece, key), key).copy_(part)

    return write


def safe_set_full_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    _set(param, value, _state_writer(optim_state_key), full=True)


def safe_set_local_optimizer_state(param: torch.Tensor, value: torch.Tensor, optim_state_key: str) -> None:
    _set(param, value, _state_writer(optim_state_key), full=False)


def _settled(name: str, param: torch.Tensor) -> tuple[Any, str, float] | None:
    """(optimizer, name, the step's gradient divisor) with this step's gradients reduced into the owned grad
    storage; None for a parameter no engine trains (DeepSpeed gives None there too)."""
    found = _engine_of(param)
    if found is None:
        return None
    engine, optimizer, param_name = found
    if not engine.is_gradient_accumulation_boundary():
        raise RuntimeError(
            f"{name}({param_name}): the gradient accessors work after the last backward of an optimizer step and "
            f"before engine.step(); this is micro-batch {engine._window_micro_steps + 1} of "
            f"{engine.gradient_accumulation_steps()} (gradient_accumulation_steps). Call it at the boundary "
            "(engine.is_gradient_accumulation_boundary() is True)"
        )
    optimizer.settle_gradients()
    return optimizer, param_name, float(engine._step_grad_divisor())


def _grad_dtype(optimizer: Any) -> torch.dtype:
    return optimizer.groups[0].grad_storage.dtype if optimizer.groups else torch.float32


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The whole averaged gradient of `param` the next step will use (before clipping), in its global shape
    and the gradient accumulation dtype (collective; after the last backward of the step, before step())."""
    found = _settled("safe_get_full_grad", param)
    if found is None:
        return None
    optimizer, name, divisor = found
    with optimizer.gradients_resident(name):  # ZeRO-3 with NVMe offload keeps them in files
        full = _full(param, lambda _optimizer, piece: piece.grad.float() / divisor)
    return None if full is None else full.to(_grad_dtype(optimizer))


def safe_get_local_grad(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's part of `param`'s averaged gradient, flat (the part it steps: the whole tensor at stage 0)."""
    found = _settled("safe_get_local_grad", param)
    if found is None:
        return None
    optimizer, name, divisor = found
    with optimizer.gradients_resident(name):
        pieces = [piece.grad.float() / divisor for piece in _slices(optimizer, name, disjoint=False)]
    flat = torch.cat(pieces) if pieces else torch.empty(0)
    return flat.to(_grad_dtype(optimizer))


def _set_grad(name: str, param: torch.Tensor, value: torch.Tensor, *, full: bool) -> None:
    found = _settled(name, param)
    if found is None:
        raise ValueError(
            f"{name}: this parameter is not trained by any Slipstream engine; pass one of engine.parameters()"
        )
    optimizer, param_name, divisor = found
    flat = value.detach().reshape(-1)
    pieces = _slices(optimizer, param_name, disjoint=False)
    expected = (
        (param.ds_numel if hasattr(param, "ds_numel") else param.numel()) if full else sum(p.numel for p in pieces)
    )
    padded = getattr(param, "ds_tensor", None)  # stage 3: the shard with its padding, as DeepSpeed's callers size it
    if not full and padded is not None and flat.numel() == padded.numel():
        flat = flat[:expected]
    if flat.numel() != expected:
        raise ValueError(
            f"{name}({param_name}): the value has {flat.numel()} elements, the "
            f"{'parameter' if full else 'part this rank holds'} has {expected}"
        )
    offset = 0
    with optimizer.gradients_resident(param_name, changed=True):
        for piece in _slices(optimizer, param_name, disjoint=False):  # the gradient views exist in the block
            part = flat[piece.lo : piece.hi] if full else flat[offset : offset + piece.numel]
            offset += piece.numel
            piece.grad.copy_(part.to(device=piece.grad.device, dtype=torch.float32) * divisor)


def safe_set_full_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Make the next step use `value` (the whole tensor, the same on every rank) as `param`'s averaged gradient."""
    _set_grad("safe_set_full_grad", param, value, full=True)


def safe_set_local_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Make the next step use `value` as this rank's part of `param`'s averaged gradient (the shape
    safe_get_local_grad returns)."""
    _set_grad("safe_set_local_grad", param, value, full=False)


def safe_update_full_grad_vectorized(
    param_list: Iterable[torch.Tensor], update_func: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> None:
    """For each parameter: its averaged gradient := update_func(current averaged gradient, parameter)
    (collective, like safe_get_full_grad; parameters that no engine trains are skipped)."""
    for param in param_list:
        if not param.requires_grad:
            continue
        grad = safe_get_full_grad(param)
        if grad is None:
            continue
        safe_set_full_grad(param, update_func(grad, param))

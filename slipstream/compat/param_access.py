"""DeepSpeed's `safe_get_*` / `safe_set_*` helpers: one parameter's fp32 master values and optimizer state,
whole or this rank's part, whatever the ZeRO stage.

They read and write through the optimizer's `owned_slices` (zero/slices.py), the same view checkpoints use,
so they never depend on a stage's layout. The `full` variants are collective (every rank calls them, as in
DeepSpeed): each rank fills its own disjoint part and one all-reduce assembles the tensor. A setter writes
the master values and then publishes them to the model's parameters on every rank. A parameter that no
engine trains gives None, as in DeepSpeed. Engines are found through `register_engine` (the engine's
DeepSpeed-method mixin registers itself, weakly).

Gradients (`safe_get_full_grad`, `safe_get_local_grad`, the `*_grad` setters) are not offered: Slipstream
reduces gradients into flat buckets and averages them once, at the step (docs/design.md D7), so between
backward and step no per-parameter averaged gradient exists to hand out. They raise NotImplementedError.
"""

from __future__ import annotations

import weakref
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
]

_ENGINES: weakref.WeakSet[Any] = weakref.WeakSet()


def register_engine(engine: Any) -> None:
    _ENGINES.add(engine)


def _owner(param: torch.Tensor) -> tuple[Any, str] | None:
    for engine in list(_ENGINES):
        optimizer: Any = getattr(engine, "optimizer", None)
        names = getattr(optimizer, "param_names", None)
        if names and id(param) in names and any(p is param for p in optimizer.trainable_params()):
            return optimizer, names[id(param)]
    return None


def _slices(optimizer: Any, name: str) -> list[Any]:
    return [s for s in optimizer.owned_slices(optimizer.param_names, for_save=True) if s.name == name]


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
    slices = _slices(optimizer, name)
    numel = param.ds_numel if hasattr(param, "ds_numel") else param.numel()
    shape = tuple(param.ds_shape) if hasattr(param, "ds_shape") else tuple(param.shape)
    device = slices[0].value.device if slices else param.device
    full = torch.zeros(numel, dtype=torch.float32, device=device)
    for piece in slices:
        full[piece.lo : piece.hi] = read(optimizer, piece).float()
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        from slipstream.comm import collectives

        collectives.all_reduce(full)
    return full.view(shape)


def _local(param: torch.Tensor, read: Any) -> torch.Tensor | None:
    found = _owner(param)
    if found is None:
        return None
    optimizer, name = found
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


def _no_grads(name: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{name}: Slipstream has no per-parameter averaged gradient between backward and step (gradients "
            "are reduced into flat buckets and averaged once, at the step: docs/design.md D7); read "
            "engine.get_global_grad_norm() after step, or the fp32 parameters with safe_get_full_fp32_param"
        )

    refuse.__name__ = name
    return refuse


safe_get_full_grad = _no_grads("safe_get_full_grad")
safe_get_local_grad = _no_grads("safe_get_local_grad")
safe_set_full_grad = _no_grads("safe_set_full_grad")
safe_set_local_grad = _no_grads("safe_set_local_grad")

"""Checks a load runs before it changes anything: every tensor fits what it fills, every scalar has its type.

[Note: load checks]
- Names: a parameter the checkpoint lacks, or a checkpoint parameter the model lacks, is an error unless
  `load_module_strict=False` (DeepSpeed's option), which loads what matches and warns about the rest.
- Shapes: every tensor the load copies -- `module/<name>`, `optimizer/<name>/<state>`, buffers, this rank's
  RNG state -- must have the GLOBAL shape of the parameter, state or buffer it fills. A mismatch is always an
  error (no option skips it): a flat copy would silently take the first elements of a bigger tensor, or the
  elements of a transposed one in the wrong order.
- Dtypes: floating point fills floating point (fp32 masters into a bf16 model and the other way round is
  how mixed precision saves and loads); any other dtype only fills the same dtype (an integer buffer).
- Scalars the load restores (step counters, optimizer steps and hyperparameters, scheduler, loss scale)
  must have the JSON type that fits: `global_steps: "abc"` is refused, not cast.
Every problem is reported in one CheckpointError before any value is copied, so a refused load leaves the
engine as it was. The verdict depends only on the manifest and the model's global shapes, so every rank
reaches the same one (no rank is left waiting in a collective).
"""

from __future__ import annotations

from typing import Any

import torch

from slipstream.checkpoint.errors import CheckpointError
from slipstream.checkpoint.manifest import DTYPE_NAMES
from slipstream.checkpoint.source import TensorSource, WrapsOptimizer
from slipstream.checkpoint.state import EngineParts, global_shape
from slipstream.utils.logging import warn_once

_SHOWN = 20
_ENGINE_COUNTERS = ("global_steps", "global_samples", "skipped_steps", "micro_steps")
_DTYPE_SHORT = {dtype: name for name, dtype in DTYPE_NAMES.items()}


def _dtype_text(dtype: torch.dtype) -> str:
    return _DTYPE_SHORT.get(dtype, str(dtype).removeprefix("torch."))


def _fits_dtype(stored: torch.dtype, wanted: torch.dtype) -> bool:
    return stored == wanted or (stored.is_floating_point and wanted.is_floating_point)


def _tensor_problem(
    key: str, source: TensorSource, shape: tuple[int, ...], dtype: torch.dtype, what: str
) -> str | None:
    """None when checkpoint tensor `key` can fill `what` (of global `shape` and `dtype`), else why not."""
    stored_shape, stored_dtype = source.info(key)
    if tuple(stored_shape) == tuple(shape) and _fits_dtype(stored_dtype, dtype):
        return None
    return (
        f"{key}: the checkpoint has shape {list(stored_shape)} {_dtype_text(stored_dtype)}, the model's {what} "
        f"has shape {list(shape)} {_dtype_text(dtype)}"
    )


def check_names(parts: EngineParts, keys: set[str], *, strict: bool) -> None:
    """Parameters on one side only: an error when strict, a warning otherwise (see [Note: load checks])."""
    names = [parts.names.get(id(p), n) for n, p in parts.module.named_parameters()]
    buffers = {n for n, _ in parts.module.named_buffers()}
    saved = {k[len("module/") :] for k in keys if k.startswith("module/")} - buffers  # DeepSpeed keeps buffers there
    saved -= parts.held_elsewhere
    missing, unexpected = sorted(set(names) - saved), sorted(saved - set(names))
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"load_checkpoint: the checkpoint does not match the model: missing {missing[:8]}, "
            f"unexpected {unexpected[:8]}; pass load_module_strict=False to load what matches"
        )
    if missing or unexpected:
        warn_once(
            "ckpt-nonstrict",
            f"slipstream: load_checkpoint skipped parameters missing from the checkpoint "
            f"{missing[:8]} and checkpoint entries the model lacks {unexpected[:8]}",
        )


def tensor_problems(parts: EngineParts, source: TensorSource, *, load_optimizer_states: bool) -> list[str]:
    """Every checkpoint tensor the load would copy that does not fit its target (shape or dtype)."""
    keys = set(source.keys())
    problems: list[str] = []
    for local_name, param in parts.module.named_parameters():
        name = parts.names.get(id(param), local_name)
        shape, dtype = global_shape(parts, name, tuple(param.shape)), param.dtype  # ZeRO-3 keeps its full shape
        if f"module/{name}" in keys:
            problems.append(_tensor_problem(f"module/{name}", source, shape, dtype, f"parameter {name!r}") or "")
        if load_optimizer_states and parts.optimizer is not None:
            prefix = f"optimizer/{name}/"
            for state_key in sorted(k for k in keys if k.startswith(prefix)):
                problems.append(
                    _tensor_problem(state_key, source, shape, torch.float32, f"optimizer state of {name!r}") or ""
                )
    for name, buffer in parts.module.named_buffers():
        key = next((k for k in (f"buffer/{name}", f"module/{name}") if k in keys), None)
        if key is not None:
            problems.append(_tensor_problem(key, source, tuple(buffer.shape), buffer.dtype, f"buffer {name!r}") or "")
    cpu_rng = f"rng/{parts.rank}/cpu"
    if cpu_rng in keys and (source.scalars or {}).get("world_size", parts.world_size) == parts.world_size:
        state = torch.get_rng_state()
        problems.append(_tensor_problem(cpu_rng, source, tuple(state.shape), state.dtype, "CPU RNG state") or "")
    return [p for p in problems if p]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _typed(problems: list[str], where: str, value: object, kind: type | tuple[type, ...], expected: str) -> bool:
    """Record a problem unless `value` is an instance of `kind`; returns whether it is."""
    if isinstance(value, kind):
        return True
    problems.append(f"scalars.{where} is {value!r} ({type(value).__name__}); expected {expected}")
    return False


def _engine_problems(scalars: dict[str, Any], problems: list[str]) -> None:
    engine = scalars.get("engine")
    if engine is not None and _typed(problems, "engine", engine, dict, "an object of step counters"):
        for name in _ENGINE_COUNTERS:
            value = engine.get(name, 0)
            if not _is_int(value) or value < 0:
                problems.append(
                    f"scalars.engine.{name} is {value!r} ({type(value).__name__}); expected a non-negative integer"
                )
    for name in ("lr_scheduler", "loss_scaler", "client_state"):
        if scalars.get(name) is not None:
            _typed(problems, name, scalars[name], dict, "an object (or null)")
    if not _is_int(scalars.get("world_size", 1)):
        _typed(problems, "world_size", scalars["world_size"], int, "an integer")


def _group_problems(optimizer: WrapsOptimizer, saved: dict[str, object], index: int, problems: list[str]) -> None:
    """One saved param group's hyperparameters against the live group (numbers stay numbers, tuples tuples)."""
    group = optimizer.optimizer.param_groups[index] if index < len(optimizer.optimizer.param_groups) else {}
    for name, value in saved.items():
        current = group.get(name)
        where = f"optimizer.param_groups[{index}].{name}"
        if isinstance(current, tuple):
            if not isinstance(value, (list, tuple)) or len(value) != len(current) or not all(map(_is_number, value)):
                problems.append(
                    f"scalars.{where} is {value!r}; expected a list of {len(current)} numbers "
                    f"(the optimizer's value is {current!r})"
                )
        elif _is_number(current) and not _is_number(value):
            problems.append(f"scalars.{where} is {value!r} ({type(value).__name__}); expected a number")


def _optimizer_problems(optimizer: WrapsOptimizer, scalars: dict[str, Any], problems: list[str]) -> None:
    state = scalars.get("optimizer")
    if state is None or not _typed(problems, "optimizer", state, dict, "an object"):
        return
    groups, steps = state.get("param_groups") or [], state.get("state_scalars") or []
    if not _typed(problems, "optimizer.param_groups", groups, list, "a list of objects"):
        groups = []
    if not _typed(problems, "optimizer.state_scalars", steps, list, "a list of objects"):
        steps = []
    for index, saved in enumerate(groups):
        if _typed(problems, f"optimizer.param_groups[{index}]", saved, dict, "an object"):
            _group_problems(optimizer, saved, index, problems)
    for index, values in enumerate(steps):
        if not _typed(problems, f"optimizer.state_scalars[{index}]", values, dict, "an object"):
            continue
        for name, value in values.items():
            if not _is_number(value):
                problems.append(
                    f"scalars.optimizer.state_scalars[{index}].{name} is {value!r} "
                    f"({type(value).__name__}); expected a number"
                )


def scalar_problems(
    parts: EngineParts, scalars: object, *, restore_engine: bool, load_optimizer_states: bool
) -> list[str]:
    """Every scalar the load would restore whose JSON type does not fit (see [Note: load checks])."""
    problems: list[str] = []
    if not isinstance(scalars, dict):
        return [f"scalars is {type(scalars).__name__}; expected an object"]
    if restore_engine:
        _engine_problems(scalars, problems)
    if load_optimizer_states and parts.optimizer is not None:
        _optimizer_problems(parts.optimizer, scalars, problems)
    return problems


def check_load(
    parts: EngineParts, source: TensorSource, *, strict: bool, load_optimizer_states: bool, restore_engine: bool
) -> None:
    """Raise one CheckpointError listing every name, shape, dtype and scalar problem; see [Note: load checks]."""
    check_names(parts, set(source.keys()), strict=strict)
    shapes = tensor_problems(parts, source, load_optimizer_states=load_optimizer_states)
    scalars = scalar_problems(
        parts, source.scalars, restore_engine=restore_engine, load_optimizer_states=load_optimizer_states
    )
    if not shapes and not scalars:
        return
    lines = (shapes + scalars)[:_SHOWN]
    more = len(shapes) + len(scalars) - len(lines)
    fix = []
    if shapes:
        fix.append(
            "A tensor loads only into a parameter, optimizer state or buffer of the same shape; "
            "load_module_strict=False skips names that one side lacks, never a shape mismatch. Build the "
            "model with the checkpoint's shapes, or read the tensors you need with "
            "slipstream.checkpoint.CheckpointReader and copy them yourself."
        )
    if scalars:
        fix.append(
            "The checkpoint's scalars (the 'scalars' of manifest.json) were edited or damaged: restore the "
            "checkpoint from a copy, or pass load_module_only=True to load the weights alone."
        )
    raise CheckpointError(
        f"load_checkpoint: checkpoint {source.location} does not fit this engine; nothing was "
        "loaded:\n  " + "\n  ".join(lines) + (f"\n  ... and {more} more" if more > 0 else "") + "\n" + " ".join(fix)
    )

"""Universal checkpoints: DeepSpeed's `ds_to_universal` layout, one folder of whole tensors per parameter.

Owns `is_universal_checkpoint`, `read_universal_checkpoint` (into the same global `DeepSpeedCheckpoint` that
reader.py returns, so loading goes through `DeepSpeedSource` at any world size and stage) and
`write_universal_checkpoint`. The layout, as DeepSpeed 0.19 writes and reads it:

    <dir>/zero/<param name>/fp32.pt          the fp32 master: {"param": tensor, "cat_dim": 0, ...}, or a bare
                                             tensor (DeepSpeed's stage-3 conversion writes it flat)
    <dir>/zero/<param name>/exp_avg.pt       the optimizer's moments, same form (absent for frozen parameters)
    <dir>/zero/<param name>/exp_avg_sq.pt    (every optimizer state shaped like the parameter has its file:
                                             Muon's momentum_buffer.pt, ...)
    <dir>/zero/<param name>/step.pt          the optimizer step (stage 1-2 conversions)
    <dir>/zero/optimizer_state.pt            {"param_groups": [...], ...}
    <dir>/*model_states.pt                   the source's model-states files: counters, scheduler, buffers,
                                             client state, `param_shapes`

Tensor-parallel merges (`cat_dim`, sub-parameter shapes) happen in the converter (DeepSpeed's, or
tp_universal.py); a universal tensor is always the whole parameter, so reading needs only the value (its own
shape when the model-states files record one rank's shard). Every file goes through the restricted
unpickler (`safe_pickle.safe_load`).
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from slipstream.checkpoint.deepspeed.reader import (
    _DS_MODEL_KEYS,
    DeepSpeedCheckpoint,
    _apply_shared_params,
    _as_int,
    _merge_zero3_frozen,
    _model_dtype,
    _scalars,
    _step_of,
    _strip_params,
)
from slipstream.checkpoint.deepspeed.safe_pickle import safe_load
from slipstream.checkpoint.errors import CheckpointError

__all__ = [
    "LATEST_UNIVERSAL_FILE",
    "checkpoint_from_reader",
    "is_universal_checkpoint",
    "read_universal_checkpoint",
    "write_universal_checkpoint",
]

LATEST_UNIVERSAL_FILE = "latest_universal"
FORMAT_VERSION = "0.19.8"
"""The DeepSpeed release whose universal layout this writes: the `ds_version` of files written from a Slipstream
checkpoint (DeepSpeed's loader refuses a universal checkpoint without one)."""
_NOT_STATES = ("fp32", "step")
"""The files of a parameter's folder that are not optimizer state. Every other state shaped like the parameter
(Adam's and LAMB's `exp_avg` / `exp_avg_sq`, Muon's `momentum_buffer`, ...) has its own `<key>.pt`."""


def is_universal_checkpoint(path: str | Path) -> bool:
    """True if `path` is a universal checkpoint directory (a `zero/` folder of per-parameter folders)."""
    zero = Path(path) / "zero"
    try:
        return zero.is_dir() and any(zero.glob("*/fp32.pt"))
    except OSError:
        return False


def _value(obj: object, file: Path) -> torch.Tensor:
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, Mapping) and isinstance(obj.get("param"), torch.Tensor):
        return obj["param"]
    raise CheckpointError(
        f"{file}: expected a tensor or a dict with a 'param' tensor (DeepSpeed's universal format), found "
        f"{type(obj).__name__}{sorted(obj) if isinstance(obj, Mapping) else ''}; the file is not a universal "
        "checkpoint tensor (re-run ds_to_universal)"
    )


def _model_states(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the first model-states file, the others) in rank order; empty when the folder has none."""
    files = sorted(path.glob("*model_states.pt"))
    if not files:
        return {}, []
    first = next(
        (f for f in files if f.name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")),
        files[0],
    )
    others = [f for f in files if f != first]
    return dict(safe_load(first)), [dict(safe_load(f)) for f in others]


def read_universal_checkpoint(path: str | Path) -> DeepSpeedCheckpoint:
    """Read the universal checkpoint in `path` (the folder ds_to_universal wrote) into global tensors on the CPU."""
    path = Path(path)
    if not is_universal_checkpoint(path):
        raise CheckpointError(
            f"{path} is not a universal checkpoint: expected {path / 'zero'} with one folder per parameter holding "
            "fp32.pt. Pass the --output_folder given to ds_to_universal"
        )
    first, others = _model_states(path)
    shapes = {name: tuple(shape) for group in first.get("param_shapes") or [] for name, shape in group.items()}
    master: dict[str, torch.Tensor] = {}
    opt_state: dict[str, dict[str, torch.Tensor]] = {}
    steps: set[int] = set()  # the steps recorded per parameter (all equal in a sound checkpoint)
    for folder in sorted(p for p in (path / "zero").iterdir() if p.is_dir()):
        name = folder.name
        master[name], states, step = _read_param_folder(folder, shapes.get(name))
        if states:
            opt_state[name] = states
        if step is not None:
            steps.add(step)
    optimizer_file = path / "zero" / "optimizer_state.pt"
    optimizer: Mapping[str, Any] = safe_load(optimizer_file) if optimizer_file.is_file() else {}
    optimizer_step = _optimizer_step(steps, optimizer, path)
    module = _module(first, others, master)
    _apply_shared_params(first.get("shared_params") or {}, module, master)
    return DeepSpeedCheckpoint(
        tag=path.name,
        zero_stage=_as_int(optimizer.get("zero_stage") or 0),
        world_size=int(first.get("dp_world_size", 1) or 1),
        dtype=_model_dtype(first) if first.get("module") else "fp32",
        module=module,
        master=master,
        optimizer_state=opt_state,
        optimizer_step=optimizer_step,
        param_groups=_strip_params(list(optimizer.get("param_groups") or [])),
        scalars=_scalars(first, optimizer),
        client_state={k: v for k, v in first.items() if k not in _DS_MODEL_KEYS and k != "universal_checkpoint_info"},
    )


def _read_param_folder(
    folder: Path, recorded_shape: tuple[int, ...] | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor], int | None]:
    """One parameter's folder: (its fp32 master, its optimizer states by key, its step.pt or None)."""
    fp32 = folder / "fp32.pt"
    if not fp32.is_file():
        raise CheckpointError(
            f"{folder} has no fp32.pt: the universal checkpoint is incomplete (re-run the conversion)"
        )
    loaded = safe_load(fp32)
    value = _value(loaded, fp32).float()
    shape = recorded_shape if recorded_shape is not None else tuple(value.shape)
    if isinstance(loaded, Mapping) and math.prod(shape) != value.numel():
        # a tensor-parallel conversion: the file holds the whole tensor, param_shapes one rank's shard
        shape = tuple(value.shape)
    if math.prod(shape) != value.numel():
        raise CheckpointError(
            f"{fp32}: {value.numel()} elements, but the model-states file records shape {shape} for {folder.name!r}"
        )
    states = {}
    for file in sorted(folder.glob("*.pt")):
        if file.stem not in _NOT_STATES:
            state = _value(safe_load(file), file).float()
            if state.numel() == value.numel():  # optimizer state shaped like the parameter
                states[file.stem] = state.reshape(shape)
    step_file = folder / "step.pt"
    step = _step_of({"step": safe_load(step_file)}) if step_file.is_file() else None
    return value.reshape(shape), states, step


def _optimizer_step(steps: set[int], optimizer: Mapping[str, Any], path: Path) -> int | None:
    """The checkpoint's one optimizer step: from the parameters' step.pt files, else the optimizer state."""
    if not steps:  # stage-3 conversions keep the step only in the first rank's optimizer state dict
        inner = (optimizer.get("optimizer_state_dict") or {}).get("state") or {}
        first_state = next(iter(inner.values()), None) if isinstance(inner, Mapping) else None
        step = _step_of(first_state) if isinstance(first_state, Mapping) else None
        if step is not None:
            steps.add(step)
    if len(steps) > 1:
        raise CheckpointError(
            f"{path}: the parameters' step.pt files disagree ({sorted(steps)}); re-run the conversion"
        )
    return next(iter(steps)) if steps else None


def _module(
    first: Mapping[str, Any], others: list[dict[str, Any]], master: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The module's tensors: buffers (and frozen parameters) from the model-states file, parameters from the
    fp32 masters in the model's dtype (stage-3 model-states files hold only placeholders for parameters)."""
    saved = {k: v for k, v in (first.get("module") or {}).items() if isinstance(v, torch.Tensor)}
    module = dict(saved)
    if first.get("frozen_param_shapes") and first.get("frozen_param_fragments"):
        _merge_zero3_frozen(first, others, module)
    for name, value in master.items():
        placeholder = saved.get(name)
        module[name] = value.to(placeholder.dtype) if isinstance(placeholder, torch.Tensor) else value
    return module


def write_universal_checkpoint(
    checkpoint: DeepSpeedCheckpoint, out: str | Path, *, model_state_files: list[Path] | None = None
) -> Path:
    """Write `checkpoint` (global tensors) in the universal layout into `out`.

    `model_state_files` (a DeepSpeed source's `*model_states.pt`) are copied as they are, as DeepSpeed's
    converter does; without them one `mp_rank_00_model_states.pt` is written from the checkpoint's module,
    counters and client state."""
    out = Path(out)
    zero = out / "zero"
    zero.mkdir(parents=True, exist_ok=True)
    step = checkpoint.optimizer_step
    for name, value in checkpoint.master.items():
        folder = zero / name
        folder.mkdir(exist_ok=True)
        torch.save({"param": value.detach().float().contiguous(), "cat_dim": 0}, folder / "fp32.pt")
        for key, state in checkpoint.optimizer_state.get(name, {}).items():
            if key not in _NOT_STATES and state.numel() == value.numel():
                torch.save({"param": state.detach().float().contiguous(), "cat_dim": 0}, folder / f"{key}.pt")
        if step is not None and name in checkpoint.optimizer_state:
            torch.save(torch.tensor(float(step)), folder / "step.pt")
    groups = [{**group, "params": [index]} for index, group in enumerate(checkpoint.param_groups)]
    version = str(checkpoint.scalars.get("ds_version") or FORMAT_VERSION)
    torch.save(
        {"param_groups": groups, "zero_stage": checkpoint.zero_stage, "ds_version": version},
        zero / "optimizer_state.pt",
    )
    if model_state_files:
        for file in model_state_files:
            shutil.copy2(file, out / file.name)
    else:
        torch.save(_model_states_of(checkpoint), out / "mp_rank_00_model_states.pt")
    return out


def _model_states_of(checkpoint: DeepSpeedCheckpoint) -> dict[str, Any]:
    scalars = checkpoint.scalars
    params = set(checkpoint.master)
    return {
        **checkpoint.client_state,
        "module": {name: value.detach().contiguous() for name, value in checkpoint.module.items()},
        "buffer_names": [name for name in checkpoint.module if name not in params],
        "param_shapes": [{name: torch.Size(value.shape) for name, value in checkpoint.master.items()}],
        "global_steps": int(scalars.get("global_steps") or 0),
        "global_samples": int(scalars.get("global_samples") or 0),
        "skipped_steps": int(scalars.get("skipped_steps") or 0),
        "lr_scheduler": scalars.get("lr_scheduler"),
        "dp_world_size": checkpoint.world_size,
        "mp_world_size": 1,
        "ds_version": str(scalars.get("ds_version") or FORMAT_VERSION),
    }


def checkpoint_from_reader(reader: Any) -> DeepSpeedCheckpoint:
    """A Slipstream checkpoint (an open `CheckpointReader`) as global tensors: the masters (or the values of
    parameters without one) under `module/`, the optimizer state under `optimizer/<name>/`."""
    scalars = reader.scalars
    module: dict[str, torch.Tensor] = {}
    master: dict[str, torch.Tensor] = {}
    opt_state: dict[str, dict[str, torch.Tensor]] = {}
    for key in reader.keys():
        kind, _, rest = key.partition("/")
        if kind == "module":
            module[rest] = reader.read(key)
            if not reader.entry(key).frozen:
                master[rest] = module[rest].float()
        elif kind == "buffer":
            module[rest] = reader.read(key)
        elif kind == "optimizer":
            name, _, state_key = rest.rpartition("/")
            opt_state.setdefault(name, {})[state_key] = reader.read(key).float()
    optimizer = scalars.get("optimizer") or {}
    state_scalars = optimizer.get("state_scalars") or []
    steps = {int(s["step"]) for s in state_scalars if isinstance(s, Mapping) and "step" in s}
    engine = scalars.get("engine") or {}
    return DeepSpeedCheckpoint(
        tag=reader.ckpt_dir.name,
        zero_stage=int(scalars.get("zero_stage") or 0),
        world_size=int(scalars.get("world_size") or 1),
        dtype="fp32",
        module=module,
        master=master,
        optimizer_state=opt_state,
        optimizer_step=max(steps) if steps else None,
        param_groups=[dict(g) for g in optimizer.get("param_groups") or []],
        scalars={
            "global_steps": engine.get("global_steps", 0),
            "global_samples": engine.get("global_samples", 0),
            "skipped_steps": engine.get("skipped_steps", 0),
            "lr_scheduler": scalars.get("lr_scheduler"),
            "ds_version": FORMAT_VERSION,
        },
        client_state=dict(scalars.get("client_state") or {}),
    )

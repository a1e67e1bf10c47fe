"""Reading checkpoints written by DeepSpeed 0.19 (ZeRO stages 0 to 3, fp32 / bf16) into global tensors.

Owns `is_deepspeed_checkpoint`, `read_deepspeed_checkpoint` and the `DeepSpeedCheckpoint` they return. Every
file goes through `safe_pickle.safe_load` (restricted unpickler, never `weights_only=False`). The layout is
DeepSpeed's (reference section 5); the flat-partition arithmetic follows DeepSpeed's `zero_to_fp32.py`:

- stage 0: `mp_rank_00_model_states.pt` holds the whole module and a torch optimizer state dict (for bf16, the
  FP16_UnfusedOptimizer wrapper with per-parameter fp32 masters in `fp32_groups`).
- stages 1/2: each rank's `single_partition_of_fp32_groups[g]` (padding stripped) and the matching slice of the
  base optimizer's flat state are concatenated in rank order, then cut by `param_shapes[g]` in order, skipping
  `param_alignment_paddings`.
- stage 3: each parameter owns `ceil(numel / world_size)` consecutive elements of every rank's flat fp32 buffer
  (all groups concatenated); the pieces are concatenated in rank order and the padding at the end dropped. The
  Adam moments use the same rule.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from slipstream.checkpoint.deepspeed.safe_pickle import DeepSpeedStub, safe_load
from slipstream.checkpoint.errors import CheckpointError

_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# Keys DeepSpeed itself writes into *_model_states.pt (engine._common_checkpoint_state); the rest is client_state.
_DS_MODEL_KEYS = frozenset(
    {
        "module",
        "buffer_names",
        "optimizer",
        "param_shapes",
        "frozen_param_shapes",
        "shared_params",
        "frozen_param_fragments",
        "lr_scheduler",
        "data_sampler",
        "random_ltd",
        "sparse_tensor_module_names",
        "skipped_steps",
        "global_steps",
        "global_samples",
        "dp_world_size",
        "mp_world_size",
        "checkpoint_parallel_dimensions",
        "ds_config",
        "ds_version",
    }
)
_MP00 = "mp_rank_00_model_states.pt"
_ZERO3_MODEL = "zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
_OPTIM = "{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


@dataclass
class DeepSpeedCheckpoint:
    """A DeepSpeed checkpoint as global (unsharded) tensors keyed by parameter name."""

    tag: str
    zero_stage: int
    world_size: int
    """Data-parallel world size the checkpoint was saved at."""
    dtype: str
    """Model weight dtype: "fp32", "bf16" or "fp16"."""
    module: dict[str, torch.Tensor]
    """Full model weights and buffers by name, in the saved dtype (stage 3: rebuilt from the fp32 partitions)."""
    master: dict[str, torch.Tensor]
    """fp32 master weights by parameter name (at stages 1-3 trainable parameters only: frozen ones, which ZeRO
    keeps no master for, are in `module` alone)."""
    optimizer_state: dict[str, dict[str, torch.Tensor]]
    """Parameter name -> {"exp_avg": ..., "exp_avg_sq": ...}, global fp32 tensors shaped like the parameter."""
    optimizer_step: int | None
    param_groups: list[dict[str, Any]]
    """Optimizer hyperparameters per group, without "params"."""
    scalars: dict[str, Any]
    """global_steps, global_samples, skipped_steps, lr_scheduler, loss_scaler, ds_config, ds_version, ..."""
    client_state: dict[str, Any] = field(default_factory=dict)
    """Keys of the model-states file that DeepSpeed did not write itself (save_checkpoint's client_state)."""


def _tag_dir(path: Path, tag: str | None) -> Path:
    """The tag directory `path` designates: `path/tag`, `path/<latest>`, or `path` itself."""
    if tag is not None:
        return path / tag
    latest = path / "latest"
    if latest.is_file():
        return path / latest.read_text().strip()
    return path


def is_deepspeed_checkpoint(path: str | Path, tag: str | None = None) -> bool:
    """True if `path` is a DeepSpeed save_dir (with `latest` or the given tag) or tag dir holding model states."""
    try:
        tag_dir = _tag_dir(Path(path), tag)
        return tag_dir.is_dir() and any(tag_dir.glob("*model_states.pt"))
    except OSError:
        return False


def read_deepspeed_checkpoint(path: str | Path, tag: str | None = None) -> DeepSpeedCheckpoint:
    """Read the DeepSpeed checkpoint at `path` (a save_dir, or a tag dir) into global tensors on the CPU."""
    path = Path(path)
    tag_dir = _tag_dir(path, tag)
    if not tag_dir.is_dir() or not any(tag_dir.glob("*model_states.pt")):
        raise CheckpointError(
            f"{path} is not a DeepSpeed checkpoint: expected a `latest` file naming a tag directory, or a tag "
            f"directory with *model_states.pt files (tag={tag!r}, looked in {tag_dir}). Pass the save_dir given "
            "to save_checkpoint, or the global_stepN directory inside it."
        )
    if any(tag_dir.glob("mp_rank_01_*")) or any(tag_dir.glob("*_mp_rank_01_*")) or any(tag_dir.glob("layer_*")):
        raise CheckpointError(
            f"{tag_dir} was saved with tensor or pipeline parallelism (mp_rank_01 / layer_* "
            "files); only data-parallel DeepSpeed checkpoints are read directly. Convert it with "
            f"`python -m slipstream.checkpoint.ds_to_universal --input_folder {tag_dir} --output_folder "
            f"{tag_dir}_universal` and load the universal checkpoint (checkpoint.load_universal)."
        )
    stage3 = any(tag_dir.glob(_ZERO3_MODEL.format(rank="*")))
    if stage3:
        _require_files(tag_dir, [_ZERO3_MODEL.format(rank=0)])
    first = safe_load(tag_dir / (_ZERO3_MODEL.format(rank=0) if stage3 else _MP00))
    world_size = int(first.get("dp_world_size", 1))
    if stage3:
        _require_files(tag_dir, [_ZERO3_MODEL.format(rank=r) for r in range(world_size)])
    optim: list[dict[str, Any]] = []
    if first.get("param_shapes") is None and not stage3:
        result = _read_stage0(first)
        stage = 0
    else:
        optim = _read_optim_files(tag_dir, world_size)
        stage = _zero_stage(optim[0], tag_dir)
        if stage3 != (stage == 3):
            raise CheckpointError(
                f"{tag_dir}: the optimizer files say zero_stage={stage} but the model files are "
                f"laid out for {'stage 3' if stage3 else 'stages 0-2'}; the directory mixes "
                "two checkpoints. Re-save it, or copy one checkpoint's files only."
            )
        reader = _read_stage3 if stage == 3 else _read_stage12
        result = reader(first, optim, world_size)
    if stage3 and first.get("frozen_param_shapes"):
        others = [safe_load(tag_dir / _ZERO3_MODEL.format(rank=r)) for r in range(1, world_size)]
        _merge_zero3_frozen(first, others, result.module)
    _apply_shared_params(first.get("shared_params") or {}, result.module, result.master)
    return DeepSpeedCheckpoint(
        tag=tag_dir.name,
        zero_stage=stage,
        world_size=world_size,
        dtype=_model_dtype(first),
        scalars=_scalars(first, optim[0] if optim else None),
        client_state={k: v for k, v in first.items() if k not in _DS_MODEL_KEYS},
        **result._asdict(),
    )


class _Parts(NamedTuple):
    """What a stage's reader returns: the checkpoint's tensor fields, under the names DeepSpeedCheckpoint gives
    them."""

    module: dict[str, torch.Tensor]
    master: dict[str, torch.Tensor]
    optimizer_state: dict[str, dict[str, torch.Tensor]]
    optimizer_step: int | None
    param_groups: list[dict[str, Any]]


def _require_files(tag_dir: Path, names: list[str]) -> None:
    missing = [name for name in names if not (tag_dir / name).is_file()]
    if missing:
        raise CheckpointError(
            f"DeepSpeed checkpoint {tag_dir} is incomplete: missing {missing} (one file per data-parallel rank, "
            f"{len(names)} expected). A rank did not finish saving or the files were not all copied; copy the "
            "missing files from every node, or load an earlier tag."
        )


def _read_optim_files(tag_dir: Path, world_size: int) -> list[dict[str, Any]]:
    prefix = "bf16_" if any(tag_dir.glob("bf16_zero_pp_rank_*_optim_states.pt")) else ""
    names = [_OPTIM.format(prefix=prefix, rank=r) for r in range(world_size)]
    _require_files(tag_dir, names)
    states = []
    for name in names:
        loaded = safe_load(tag_dir / name)
        if not isinstance(loaded, dict) or not isinstance(loaded.get("optimizer_state_dict"), dict):
            raise CheckpointError(
                f"{tag_dir / name} has no 'optimizer_state_dict'; it is not a DeepSpeed ZeRO "
                "optimizer file. Restore the file DeepSpeed wrote."
            )
        states.append(loaded["optimizer_state_dict"])
    return states


def _as_int(value: Any) -> int:
    return int(value.value if isinstance(value, DeepSpeedStub) else value)


def _zero_stage(osd: Mapping[str, object], tag_dir: Path) -> int:
    stage = _as_int(osd.get("zero_stage", -1))
    if stage not in (1, 2, 3):
        raise CheckpointError(
            f"{tag_dir}: unknown zero_stage {osd.get('zero_stage')!r} in the optimizer files; "
            "only DeepSpeed ZeRO stages 0, 1, 2 and 3 can be imported."
        )
    return stage


def _model_dtype(first: Mapping[str, Any]) -> str:
    buffers = set(first.get("buffer_names") or [])
    for name, tensor in (first.get("module") or {}).items():
        if name not in buffers and isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
            return _DTYPE_NAMES.get(tensor.dtype, str(tensor.dtype))
    return "fp32"


def _param_names(first: Mapping[str, Any]) -> list[str]:
    buffers = set(first.get("buffer_names") or [])
    return [name for name in first["module"] if name not in buffers]


def _strip_params(groups: list[dict[str, object]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in group.items() if k != "params"} for group in groups]


def _step_of(state: Mapping[str, Any]) -> int | None:
    step = state.get("step")
    if step is None:
        return None
    return int(step.item() if isinstance(step, torch.Tensor) else step)


def _read_stage0(first: Mapping[str, Any]) -> _Parts:
    module = dict(first["module"])
    names = _param_names(first)
    opt = first.get("optimizer")
    if opt is None:
        return _Parts(module, {n: module[n].float() for n in names}, {}, None, [])
    if "fp32_groups_flat" in opt:
        raise CheckpointError(
            "stage-0 fp16 checkpoints (DeepSpeed FP16_Optimizer, 'fp32_groups_flat') cannot be "
            "imported yet; convert it with DeepSpeed's zero_to_fp32.py or save with bf16/ZeRO."
        )
    base = opt["optimizer_state_dict"] if "fp32_groups" in opt else opt
    masters = [t for group in opt["fp32_groups"] for t in group] if "fp32_groups" in opt else [module[n] for n in names]
    indices = [i for group in base["param_groups"] for i in group["params"]]
    if len(indices) != len(names) or len(masters) != len(names):
        raise CheckpointError(
            f"stage-0 checkpoint: the optimizer holds {len(indices)} parameters but the module has {len(names)} "
            f"({names}); frozen or tied parameters make the mapping ambiguous. Import with load_optimizer_states="
            "False, or convert with DeepSpeed's zero_to_fp32.py."
        )
    master = {n: m.float() for n, m in zip(names, masters)}
    opt_state: dict[str, dict[str, torch.Tensor]] = {}
    step = None
    for name, index in zip(names, indices):
        state = base["state"].get(index, {})
        opt_state[name] = {k: v.float() for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
        step = step if step is not None else _step_of(state)
    return _Parts(module, master, opt_state, step, _strip_params(base["param_groups"]))


def _group_state(base: Any, group: int) -> dict[str, Any]:
    """The torch optimizer state of flat group `group` (a state dict, or DeepSpeed's elastic per-group list)."""
    if isinstance(base, list):
        return dict(base[group])
    index = base["param_groups"][group]["params"][0]
    return dict(base["state"].get(index, {}))


def _flat_keys(state: Mapping[str, object], numel: int) -> list[str]:
    return [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() >= numel]


def _read_stage12(first: Mapping[str, Any], optim: list[dict[str, Any]], world_size: int) -> _Parts:
    module = dict(first["module"])
    master: dict[str, torch.Tensor] = {}
    opt_state: dict[str, dict[str, torch.Tensor]] = {}
    paddings = optim[0].get("param_alignment_paddings")
    for g, shapes in enumerate(first["param_shapes"]):
        parts = [osd["single_partition_of_fp32_groups"][g] for osd in optim]
        states = [_group_state(osd["base_optimizer_state"], g) for osd in optim]
        flats = {"master": torch.cat([p.float() for p in parts])}
        for key in _flat_keys(states[0], parts[0].numel()):
            flats[key] = torch.cat([st[key][: p.numel()].float() for st, p in zip(states, parts)])
        offset = 0
        for i, (name, shape) in enumerate(shapes.items()):
            numel = math.prod(shape)
            _check_room(name, offset + numel, flats["master"].numel(), g)
            pieces = {k: v[offset : offset + numel].view(tuple(shape)).clone() for k, v in flats.items()}
            master[name] = pieces.pop("master")
            opt_state[name] = pieces
            offset += numel + (int(paddings[g][i]) if paddings else 0)
    base = optim[0]["base_optimizer_state"]
    if isinstance(base, list):
        step = optim[0].get("base_optimizer_state_step")
        groups: list[dict[str, Any]] = []
    else:
        step = _step_of(_group_state(base, 0))
        groups = _strip_params(base["param_groups"])
    return _Parts(module, master, opt_state, None if step is None else int(step), groups)


def _check_room(name: str, needed: int, available: int, group: int) -> None:
    if needed > available:
        raise CheckpointError(
            f"parameter {name!r} of group {group} needs elements up to {needed} but the rank "
            f"partitions hold only {available}; the optimizer files do not match param_shapes "
            "(mixed checkpoints or a different world size). Re-save the checkpoint."
        )


def _zero3_param(flats: list[torch.Tensor], offset: int, numel: int, shape: Any) -> torch.Tensor:
    """One parameter from stage-3 rank flats: ceil(numel/ws) elements from each rank, padding dropped."""
    chunk = math.ceil(numel / len(flats))
    return torch.cat([flat[offset : offset + chunk] for flat in flats])[:numel].view(tuple(shape)).clone()


def _read_stage3(first: Mapping[str, Any], optim: list[dict[str, Any]], world_size: int) -> _Parts:
    shapes = {name: shape for group in first["param_shapes"] for name, shape in group.items()}
    num_groups = len(optim[0]["fp32_flat_groups"])
    rank_flats = {"master": [torch.cat([g.float() for g in osd["fp32_flat_groups"]]) for osd in optim]}
    states = [[_group_state(osd["optimizer_state_dict"], g) for g in range(num_groups)] for osd in optim]
    for key in _flat_keys(states[0][0], optim[0]["fp32_flat_groups"][0].numel()):
        rank_flats[key] = [torch.cat([st[key].float() for st in rank]) for rank in states]
    master: dict[str, torch.Tensor] = {}
    opt_state: dict[str, dict[str, torch.Tensor]] = {}
    offset = 0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        _check_room(name, offset + math.ceil(numel / world_size), rank_flats["master"][0].numel(), 0)
        pieces = {k: _zero3_param(flats, offset, numel, shape) for k, flats in rank_flats.items()}
        master[name] = pieces.pop("master")
        opt_state[name] = pieces
        offset += math.ceil(numel / world_size)
    module = dict(first["module"])
    for name, tensor in master.items():
        placeholder = module.get(name)
        module[name] = tensor.to(placeholder.dtype if isinstance(placeholder, torch.Tensor) else tensor.dtype)
    base = optim[0]["optimizer_state_dict"]
    return _Parts(module, master, opt_state, _step_of(states[0][0]), _strip_params(base["param_groups"]))


def _merge_zero3_frozen(
    first: Mapping[str, Any], others: list[dict[str, Any]], module: dict[str, torch.Tensor]
) -> None:
    """Frozen stage-3 parameters are saved as each rank's padded fragment in `frozen_param_fragments`."""
    for name, shape in first["frozen_param_shapes"].items():
        fragments = [states["frozen_param_fragments"][name] for states in [first, *others]]
        module[name] = torch.cat(fragments)[: math.prod(shape)].view(tuple(shape)).clone()


def _apply_shared_params(shared: Mapping[str, str], *tables: dict[str, torch.Tensor]) -> None:
    """Tied parameters are saved once; alias each tied name to its source, as zero_to_fp32 does."""
    for name, source in shared.items():
        for table in tables:
            if source in table:
                table[name] = table[source]


def _loss_scaler(value: object) -> Any:
    return dict(value.state) if isinstance(value, DeepSpeedStub) else value


def _scalars(first: Mapping[str, object], osd: Mapping[str, object] | None) -> dict[str, Any]:
    keys = (
        "global_steps",
        "global_samples",
        "skipped_steps",
        "lr_scheduler",
        "data_sampler",
        "random_ltd",
        "ds_config",
        "ds_version",
        "dp_world_size",
        "mp_world_size",
        "checkpoint_parallel_dimensions",
    )
    scalars = {key: first.get(key) for key in keys}
    opt = first.get("optimizer")
    if osd is not None:
        scalars["loss_scaler"] = _loss_scaler(osd.get("loss_scaler"))
        scalars["dynamic_loss_scale"] = osd.get("dynamic_loss_scale")
        scalars["clip_grad"] = osd.get("clip_grad")
    elif isinstance(opt, dict) and "cur_scale" in opt:
        scalars["loss_scaler"] = {"cur_scale": opt["cur_scale"], "cur_iter": opt.get("cur_iter")}
        scalars["dynamic_loss_scale"] = opt.get("dynamic_loss_scale")
    return scalars

"""Pipeline checkpoints keyed by parameter name, loadable at any stage count and data-parallel degree.

Layout of `save_dir/<tag>/` (written into `.tmp-<tag>` and committed atomically, checkpoint/atomic.py):
- `rank_<r>.safetensors`: rank r's part of each trainable parameter of its stage -- the fp32 master slice
  `<name>@<lo>` and each optimizer state slice `<name>@<lo>#<state>` -- where lo is the slice's first element
  in the flattened parameter; `rank_<r>.json` lists (name, shape, lo, hi) per slice and the optimizer's
  scalar state (step) per name.
- `pipeline.json` (rank 0): stage count, data-parallel degree, steps, the client state.
Names are the PipelineModule's (`<layer index>.<param>`, `tied_modules.<key>.<param>`), the same at every
stage count. A load reads, for each slice this rank owns now, the saved slices that overlap it, whichever
rank wrote them: so 2 stages x 1 load at 1 stage x 2 or at 4 stages. Tied weights are saved by every stage
that holds them (equal copies); any copy serves.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from slipstream.checkpoint.atomic import commit_dir, make_tmp_dir, read_latest, write_latest, write_text_atomic
from slipstream.checkpoint.errors import CheckpointError
from slipstream.checkpoint.safetensors_io import SafetensorsFile, save_file
from slipstream.checkpoint.source import WrapsOptimizer
from slipstream.comm import collectives


def _state_slices(optimizer: WrapsOptimizer, item: Any) -> dict[str, torch.Tensor]:
    state = optimizer.optimizer.state.get(item.piece, {})
    n = item.hi - item.lo
    return {
        k: v[item.piece_offset : item.piece_offset + n]
        for k, v in state.items()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    }


def _create_state(optimizer: WrapsOptimizer, piece: torch.Tensor, keys: list[str]) -> None:
    """A fresh optimizer has no state until its first step: make the saved tensors' slots (and `step`)."""
    state = optimizer.optimizer.state[piece]
    for key in keys:
        if key not in state:
            state[key] = torch.zeros_like(piece, dtype=torch.float32)
    if "step" not in state:
        state["step"] = torch.tensor(0.0)


def save_pipeline(engine: Any, save_dir: str, tag: str, client_state: dict[str, object], *, save_latest: bool) -> None:
    rank = dist.get_rank()
    tmp = Path(save_dir) / f".tmp-{tag}"
    if rank == 0:
        tmp = make_tmp_dir(save_dir, tag)
    collectives.barrier()
    optimizer = engine.optimizer
    tensors: dict[str, torch.Tensor] = {}
    index: dict[str, Any] = {"slices": [], "scalars": {}, "state_keys": {}}
    with optimizer.resident_state():
        for item in optimizer.owned_slices(optimizer.param_names, for_save=True):
            tensors[f"{item.name}@{item.lo}"] = item.master.detach().float().cpu().clone()
            for key, value in _state_slices(optimizer, item).items():
                tensors[f"{item.name}@{item.lo}#{key}"] = value.detach().cpu().clone()
                index["state_keys"].setdefault(item.name, []).append(key)
            index["slices"].append([item.name, list(item.shape), item.lo, item.hi])
            step = optimizer.optimizer.state.get(item.piece, {}).get("step")
            if step is not None:
                index["scalars"][item.name] = float(step)
    save_file(tensors, tmp / f"rank_{rank}.safetensors")
    write_text_atomic(tmp / f"rank_{rank}.json", json.dumps(index))
    if rank == 0:
        meta = {
            "format": "slipstream-pipeline-1",
            "stages": engine.num_stages,
            "data_parallel": engine.dp_world_size,
            "world_size": dist.get_world_size(),
            "global_steps": engine.global_steps,
            "global_samples": engine.global_samples,
            "client_state": client_state,
        }
        write_text_atomic(tmp / "pipeline.json", json.dumps(meta, default=str))
    collectives.barrier()
    if rank == 0:
        commit_dir(tmp, Path(save_dir) / tag)
        if save_latest:
            write_latest(save_dir, tag)
    collectives.barrier()


def load_pipeline(
    engine: Any, load_dir: str, tag: str | None, *, load_optimizer_states: bool
) -> tuple[str | None, dict[str, Any]]:
    tag = tag or read_latest(load_dir)
    if tag is None:
        return None, {}
    root = Path(load_dir) / tag
    meta_path = root / "pipeline.json"
    if not meta_path.exists():
        raise CheckpointError(
            f"{root} is not a Slipstream pipeline checkpoint (no pipeline.json); save it with a "
            "pipeline engine's save_checkpoint"
        )
    meta = json.loads(meta_path.read_text())
    saved, scalars, state_keys = _read_indexes(root, int(meta["world_size"]))
    optimizer = engine.optimizer
    files: dict[Path, SafetensorsFile] = {}
    try:
        with torch.no_grad(), optimizer.resident_state():
            for item in optimizer.owned_slices(optimizer.param_names, for_save=False):
                if item.name not in saved:
                    raise CheckpointError(
                        f"parameter '{item.name}' is not in the checkpoint {root}; it was saved "
                        f"from another model (saved: {sorted(saved)[:8]}...)"
                    )
                if load_optimizer_states and item.name in state_keys:
                    _create_state(optimizer, item.piece, state_keys[item.name])
                states = _state_slices(optimizer, item) if load_optimizer_states else {}
                _copy_overlaps(item, saved[item.name], states, files=files, root=root)
                if load_optimizer_states and item.name in scalars and item.piece in optimizer.optimizer.state:
                    state = optimizer.optimizer.state[item.piece]
                    if isinstance(state.get("step"), torch.Tensor):
                        state["step"].fill_(scalars[item.name])
    finally:
        for source in files.values():
            source.close()
    optimizer.publish_loaded()
    engine.global_steps = int(meta["global_steps"])
    engine.global_samples = int(meta["global_samples"])
    collectives.barrier()
    return str(root), dict(meta.get("client_state", {}))


def _read_indexes(
    root: Path, world_size: int
) -> tuple[dict[str, list[tuple[int, int, Path]]], dict[str, float], dict[str, list[str]]]:
    """Every saving rank's index: (name -> its saved (lo, hi, file) slices, name -> step, name -> state keys)."""
    saved: dict[str, list[tuple[int, int, Path]]] = {}
    scalars: dict[str, float] = {}
    state_keys: dict[str, list[str]] = {}
    for rank in range(world_size):
        index = json.loads((root / f"rank_{rank}.json").read_text())
        for name, _shape, lo, hi in index["slices"]:
            saved.setdefault(name, []).append((lo, hi, root / f"rank_{rank}.safetensors"))
        scalars.update(index["scalars"])
        state_keys.update(index["state_keys"])
    return saved, scalars, state_keys


def _copy_overlaps(
    item: Any,
    slices: list[tuple[int, int, Path]],
    states: dict[str, torch.Tensor],
    *,
    files: dict[Path, SafetensorsFile],
    root: Path,
) -> None:
    """Fill the slice this rank owns (master and `states`) from the saved slices that overlap it; `files` keeps
    the opened checkpoint files for the caller to close."""
    covered = 0
    for lo, hi, path in slices:
        a, z = max(lo, item.lo), min(hi, item.hi)
        if z <= a:
            continue
        source = files.setdefault(path, SafetensorsFile(path))
        item.master[a - item.lo : z - item.lo].copy_(
            source.get_flat_range(f"{item.name}@{lo}", a - lo, z - lo).to(item.master.dtype)
        )
        for key, value in states.items():
            value[a - item.lo : z - item.lo].copy_(
                source.get_flat_range(f"{item.name}@{lo}#{key}", a - lo, z - lo).to(value.dtype)
            )
        covered += z - a
    if covered < item.hi - item.lo:
        raise CheckpointError(
            f"the checkpoint {root} covers {covered} of the {item.hi - item.lo} "
            f"elements of '{item.name}' this rank needs: it is incomplete"
        )

"""`load_engine`: every rank reads exactly its slices of a checkpoint, at any world size and ZeRO stage.

A checkpoint holds global tensors (manifest.py, [Note: checkpoint tensors]), so resharding is reading:
each rank asks for the flat ranges its current layout owns (`state.collect_slices`), whatever layout wrote
them. Masters (or parameter values, for parameters without one) come from `module/<name>`, optimizer state
from `optimizer/<name>/<key>`; optimizer state entries that do not exist yet are created first. Then the
optimizer publishes the loaded masters into the parameters (casts, all-gathers), and the engine restores
its counters, scheduler, loss scale and RNG from the returned scalars. A DeepSpeed 0.19 checkpoint is read
through the same path (`DeepSpeedSource`), its pickles through the restricted loader (deepspeed/).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from slipstream.checkpoint.checks import check_load
from slipstream.checkpoint.deepspeed.reader import DeepSpeedCheckpoint
from slipstream.checkpoint.errors import CheckpointError
from slipstream.checkpoint.reader import CheckpointReader, direct_target
from slipstream.checkpoint.source import TensorSource, WrapsOptimizer
from slipstream.checkpoint.state import EngineParts, collect_slices, restore_optimizer_rank_tensors, restore_rng
from slipstream.utils.progress import Progress

_PROGRESS_FROM_BYTES = 256 * 2**20  # rank 0 shows load progress for models at least this large


class DeepSpeedSource:
    """A DeepSpeed checkpoint (global tensors in memory) behind the reader's interface."""

    def __init__(self, checkpoint: DeepSpeedCheckpoint, *, location: str = "<DeepSpeed checkpoint>") -> None:
        self.checkpoint = checkpoint
        self.location = location
        """Where the checkpoint was read from, for error messages."""
        self.tensors: dict[str, torch.Tensor] = {}
        for name, value in checkpoint.module.items():
            self.tensors[f"module/{name}"] = checkpoint.master.get(name, value)
        for name, states in checkpoint.optimizer_state.items():
            for key, value in states.items():
                self.tensors[f"optimizer/{name}/{key}"] = value
        step = checkpoint.optimizer_step
        groups = [dict(g) for g in checkpoint.param_groups]
        self.scalars: dict[str, Any] = {
            "engine": {k: checkpoint.scalars.get(k, 0) for k in ("global_steps", "global_samples", "skipped_steps")},
            "optimizer": {
                "param_groups": groups,
                "state_scalars": [{"step": float(step)} if step is not None else {} for _ in groups],
            },
            "lr_scheduler": checkpoint.scalars.get("lr_scheduler"),
            "client_state": {k: v for k, v in checkpoint.client_state.items() if not isinstance(v, torch.Tensor)},
        }
        self.scalars["engine"]["micro_steps"] = 0

    def keys(self) -> list[str]:
        return list(self.tensors)

    def info(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        """(global shape, dtype) of tensor `key`."""
        return tuple(self.tensors[key].shape), self.tensors[key].dtype

    def read_flat_range(self, key: str, start: int, end: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
        data = self.tensors[key].reshape(-1)[start:end]
        return data if out is None else out.view(-1).copy_(data)

    def read(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def close(self) -> None:
        self.tensors.clear()


def open_source(path: Path) -> Any:
    from slipstream.checkpoint.deepspeed.reader import is_deepspeed_checkpoint, read_deepspeed_checkpoint
    from slipstream.checkpoint.deepspeed.universal import is_universal_checkpoint, read_universal_checkpoint

    if (path / "manifest.json").is_file():
        return CheckpointReader(path, verify="lazy")  # each rank hashes only the files it reads
    if is_universal_checkpoint(path):  # before the DeepSpeed test: a universal folder holds model-states files too
        return DeepSpeedSource(read_universal_checkpoint(path), location=str(path))
    if is_deepspeed_checkpoint(path):
        return DeepSpeedSource(read_deepspeed_checkpoint(path), location=str(path))
    raise CheckpointError(
        f"{path} is neither a Slipstream checkpoint (no manifest.json), a universal one (no zero/ folder) nor a "
        "DeepSpeed one (no *model_states.pt); pass the directory that save_checkpoint or ds_to_universal wrote"
    )


def _scalar_tensor(optimizer: WrapsOptimizer, piece: Any, key: str, value: float, existing: object) -> torch.Tensor:
    """A per-piece scalar of the optimizer state (Adam's `step`) where the optimizer keeps it: beside the value it
    replaces, else as torch's optimizers place it (on the parameter's device for fused or capturable kernels,
    which refuse a CPU step; on the CPU otherwise)."""
    if isinstance(existing, torch.Tensor):
        return torch.tensor(float(value), dtype=existing.dtype, device=existing.device)
    groups = optimizer.optimizer.param_groups
    group = groups[piece.group_index] if piece.group_index < len(groups) else {}
    on_device = key == "step" and bool(group.get("fused") or group.get("capturable"))
    return torch.tensor(float(value), dtype=torch.float32, device=piece.piece.device if on_device else "cpu")


def load_engine(
    parts: EngineParts, source: TensorSource, *, strict: bool, load_optimizer_states: bool, restore_engine: bool = True
) -> dict[str, Any]:
    """Load module (and optimizer) state into the engine's tensors; returns the checkpoint's scalars.

    Everything is checked first (checks.check_load): a checkpoint that does not fit raises before any value is
    copied. `restore_engine` says whether the caller will restore the engine scalars (counters, scheduler).
    """
    check_load(parts, source, strict=strict, load_optimizer_states=load_optimizer_states, restore_engine=restore_engine)
    keys = set(source.keys())
    optimizer = parts.optimizer
    scalars = source.scalars
    state_scalars = (scalars.get("optimizer") or {}).get("state_scalars") or []
    pieces = list(collect_slices(parts, for_save=False))
    total = sum((p.hi - p.lo) * p.value.element_size() for p in pieces)
    bar = Progress("load", total, unit="MB", scale=1e6, enabled=parts.rank == 0 and total >= _PROGRESS_FROM_BYTES)
    with torch.no_grad():
        for piece in pieces:
            key = f"module/{piece.name}"
            bar.advance((piece.hi - piece.lo) * piece.value.element_size(), piece.name[-40:])
            if key not in keys:
                continue
            target = piece.master if piece.master is not None else piece.value
            data = _read_into(source, key, piece.lo, piece.hi, target)
            if piece.master is not None and piece.value.data_ptr() != piece.master.data_ptr():
                piece.value.copy_(data)
            if optimizer is None or piece.piece is None or not load_optimizer_states:
                continue
            state = optimizer.optimizer.state[piece.piece]
            prefix = f"optimizer/{piece.name}/"
            for state_key in sorted(k[len(prefix) :] for k in keys if k.startswith(prefix)):
                if state_key not in state:
                    state[state_key] = torch.zeros_like(piece.piece, dtype=optimizer.state_dtype)
                _read_into(source, prefix + state_key, piece.lo, piece.hi, piece.state_view(state, state_key))
            group_scalars = state_scalars[piece.group_index] if piece.group_index < len(state_scalars) else {}
            for scalar_key, value in group_scalars.items():
                state[scalar_key] = _scalar_tensor(optimizer, piece, scalar_key, value, state.get(scalar_key))
        if optimizer is not None and load_optimizer_states:
            saved_groups = (scalars.get("optimizer") or {}).get("param_groups") or []
            if len(saved_groups) == len(optimizer.optimizer.param_groups):
                for group, hyper in zip(optimizer.optimizer.param_groups, saved_groups):
                    for name, value in hyper.items():
                        if name in group and name != "params":
                            group[name] = tuple(value) if isinstance(group[name], tuple) else value
        if optimizer is not None and load_optimizer_states:
            restore_optimizer_rank_tensors(parts, source, scalars.get("world_size", parts.world_size))
        if optimizer is not None:
            optimizer.publish_loaded()
        elif parts.zero_model is not None:
            parts.zero_model.refresh_gathered()
        for name, buffer in parts.module.named_buffers():
            for key in (f"buffer/{name}", f"module/{name}"):
                if key in keys:
                    buffer.copy_(source.read(key).view(buffer.shape))
                    break
    rng = {k.rsplit("/", 1)[-1]: source.read(k) for k in keys if k.startswith(f"rng/{parts.rank}/")}
    if rng and scalars.get("world_size", parts.world_size) == parts.world_size:
        restore_rng(rng)
    bar.finish()
    return scalars


def _read_into(source: TensorSource, key: str, lo: int, hi: int, target: torch.Tensor) -> torch.Tensor:
    """Elements [lo, hi) of `key` into `target`; straight from the file where the layouts allow (no intermediate
    tensor: a load touches each byte of the engine's state once), else through a read and a copy (a cast, a
    device copy). Returns the data as read (for copies to other views of the same parameter)."""
    if direct_target(target, source.info(key)[1], hi - lo):
        return source.read_flat_range(key, lo, hi, out=target)
    data = source.read_flat_range(key, lo, hi)
    target.copy_(data.view(target.shape) if target.dim() > 1 else data)
    return data


def client_tensors(source: TensorSource) -> dict[str, torch.Tensor]:
    return {k[len("client/") :]: source.read(k) for k in source.keys() if k.startswith("client/")}

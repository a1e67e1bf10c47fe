"""The engine's `save_checkpoint` / `load_checkpoint` (DeepSpeed's signatures) over slipstream/checkpoint/.

The engine's own state goes into the manifest's scalars: step counters, the scheduler and loss-scale state,
optimizer hyperparameters and step counts, the resolved config and the version. Tensors go through
checkpoint/save.py and checkpoint/load.py.

Saves and loads happen at an optimizer-step boundary only; in the middle of an accumulation window they
raise, naming the micro-step. A checkpoint holds no gradients (as in DeepSpeed, which drops a partial window
silently), and a load replaces the parameters a partial window's gradients belong to. So the window after a
load starts fresh, whatever accumulation count saved the checkpoint: `micro_steps` comes back as saved (the
micro-batches trained so far), while the engine counts the boundary from its last optimizer step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from slipstream.checkpoint.atomic import read_latest
from slipstream.checkpoint.deepspeed.universal import LATEST_UNIVERSAL_FILE
from slipstream.checkpoint.errors import CheckpointError
from slipstream.checkpoint.state import (
    EngineParts,
    hyperparameters,
    scalar_state,
    shared_parameter_names,
    split_client_state,
    to_json,
)
from slipstream.comm import collectives
from slipstream.comm.collectives import CollectiveError
from slipstream.data.sampled_loader import load_sampler_state, sampler_state
from slipstream.utils.errors import ArgumentError
from slipstream.utils.logging import log_rank0, warn_once


class SaveRequest(NamedTuple):
    """save_checkpoint's arguments past the directory and tag, as the writers read them."""

    client_state: Mapping[str, object]
    save_latest: bool
    exclude_frozen: bool


class LoadRequest(NamedTuple):
    """load_checkpoint's switches, as the readers read them."""

    strict: bool
    optimizer_states: bool
    """False with `load_module_only` as well."""
    lr_scheduler_states: bool
    module_only: bool


class SaveLoad:
    """Mixin of the engine (uses its counters, optimizer, scheduler, loss scaler and plan)."""

    module: Any
    optimizer: Any
    zero_model: Any
    lr_scheduler: Any
    loss_scaler: Any
    plan: Any
    config: Any
    global_rank: int
    world_size: int
    global_steps: int
    global_samples: int
    skipped_steps: int
    micro_steps: int
    _window_micro_steps: int
    _param_names: dict[int, str]
    parallel: Any
    _held_elsewhere: frozenset[str]
    _forward_schedules: Any

    def _resident(self) -> Any:
        """Masters and optimizer states in memory (NVMe offload swaps them out between steps)."""
        stack = contextlib.ExitStack()
        if self.zero_model is not None:
            stack.enter_context(self.zero_model.resident_shards())
        if self.optimizer is not None:
            stack.enter_context(self.optimizer.resident_state())
        return stack

    def _parts(self) -> EngineParts:
        return EngineParts(
            module=self.module,
            optimizer=self.optimizer,
            zero_model=self.zero_model,
            names=self._param_names,
            rank=self.global_rank,
            world_size=self.world_size,
            stage=self.plan.zero.stage,
            tp_layouts=self.parallel.checkpoint_layouts(self.module),
            tp_rank=self.parallel.tp_rank,
            held_elsewhere=self._held_elsewhere,
        )

    def save_checkpoint(
        self,
        save_dir: str,
        tag: str | None = None,
        client_state: Mapping[str, object] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Write a checkpoint every rank can load at any world size and stage; returns True (DeepSpeed's). A
        PipelineEngine writes the pipeline's format instead (pipe/checkpoint.py)."""
        request = SaveRequest(client_state or {}, save_latest, exclude_frozen_parameters)
        self._save_checkpoint(save_dir, tag, request)
        return True

    def _save_checkpoint(self, save_dir: str, tag: str | None, request: SaveRequest) -> None:
        from slipstream import __version__
        from slipstream.checkpoint.save import save_engine

        if save_dir is None or (isinstance(save_dir, str) and not save_dir):
            raise ArgumentError(
                f"save_checkpoint(save_dir={save_dir!r}): save_dir must name a directory (it is created if "
                "missing); pass e.g. save_dir='checkpoints'"
            )
        self._check_at_boundary("save_checkpoint", "a checkpoint holds no partial gradients")
        tag = f"global_step{self.global_steps}" if tag is None else str(tag)
        client_state, save_latest, exclude_frozen = request
        values, tensors = split_client_state(client_state)
        scalars: dict[str, Any] = {
            "engine": {
                "global_steps": self.global_steps,
                "global_samples": self.global_samples,
                "skipped_steps": self.skipped_steps,
                "micro_steps": self.micro_steps,
            },
            "world_size": self.world_size,
            "zero_stage": self.plan.zero.stage,
            "lr_scheduler": to_json(self.lr_scheduler.state_dict(), "lr_scheduler.state_dict()")
            if self.lr_scheduler is not None and hasattr(self.lr_scheduler, "state_dict")
            else None,
            "loss_scaler": to_json(self.loss_scaler.state_dict(), "loss scaler state")
            if self.loss_scaler is not None
            else None,
            "client_state": values,
            "forward_schedules": self._forward_schedules.state_dict(),
            "data_sampler": sampler_state(getattr(self, "training_dataloader", None)),  # the curriculum sampler
            "config": to_json(self.config, "config"),
            "shared_params": shared_parameter_names(self.module),
        }
        if self.optimizer is not None:
            scalars["optimizer"] = {
                "param_groups": hyperparameters(self.optimizer),
                "state_scalars": scalar_state(self.optimizer),
            }
        tag_validation = self.plan.checkpoint.tag_validation
        with self._resident():
            path = save_engine(
                self._parts(),
                save_dir,
                tag,
                scalars=scalars,
                client_tensors=tensors,
                save_latest=save_latest,
                exclude_frozen=exclude_frozen,
                tag_validation=tag_validation,
                version=__version__,
            )
        log_rank0(f"checkpoint: saved {path}", rank=self.global_rank)

    def load_checkpoint(
        self,
        load_dir: str,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: object = None,
    ) -> tuple[Any, Any]:
        """Load a Slipstream (any world size, any stage) or DeepSpeed 0.19 checkpoint; returns
        (path, client_state), or (None, None) with a warning when there is nothing to load. A PipelineEngine
        loads the pipeline's format instead (pipe/checkpoint.py)."""
        optimizer_states = load_optimizer_states and not load_module_only
        request = LoadRequest(load_module_strict, optimizer_states, load_lr_scheduler_states, load_module_only)
        return self._load_checkpoint(load_dir, tag, request)

    def _load_checkpoint(self, load_dir: str, tag: str | None, request: LoadRequest) -> tuple[Any, Any]:
        from slipstream.checkpoint.load import client_tensors, load_engine, open_source

        self._check_at_boundary("load_checkpoint", "they belong to the parameters a load replaces")
        root = Path(load_dir)
        if tag is None:
            latest = LATEST_UNIVERSAL_FILE if self.plan.checkpoint.load_universal else "latest"
            tag = read_latest(root, name=latest)
            if tag is None:
                if (root / "manifest.json").is_file() or list(root.glob("*model_states.pt")):
                    tag, root = root.name, root.parent
                else:
                    warn_once(
                        f"no-ckpt:{root}",
                        f"slipstream: load_checkpoint found no `{latest}` file in {root}; "
                        "nothing loaded (pass tag=... to pick a checkpoint)",
                    )
                    return None, None
        path = root / str(tag)
        source = open_source(path)
        try:
            with self._resident():
                scalars = load_engine(
                    self._parts(),
                    source,
                    strict=request.strict,
                    load_optimizer_states=request.optimizer_states,
                    restore_engine=not request.module_only,
                )
            client = dict(scalars.get("client_state") or {})
            client.update(client_tensors(source))
            if self.world_size > 1:
                collectives.barrier()
        except CollectiveError as exc:
            # from None: the summary is the collective's whole account; chained, the log would carry it twice
            raise CheckpointError(f"load_checkpoint: {exc.summary()}. {exc.fix_for('load_checkpoint')}") from None
        finally:
            source.close()
        if not request.module_only:
            self._restore_scalars(scalars, load_lr_scheduler_states=request.lr_scheduler_states)
        log_rank0(f"checkpoint: loaded {path}", rank=self.global_rank)
        return str(path), client

    def _check_at_boundary(self, what: str, why: str) -> None:
        """Raise unless no micro-batch was stepped since the last optimizer step. Every rank has the same counters,
        so every rank raises, before any collective."""
        done = self._window_micro_steps
        if done == 0:
            return
        gas = self.plan.batch.gradient_accumulation_steps
        remaining = -done % gas or gas  # more than `gas` done only after set_gradient_accumulation_boundary(False)
        raise CheckpointError(
            f"{what} at micro-step {self.micro_steps} (global step {self.global_steps}): {_micro_batches(done)} of "
            f"gradients accumulated since the last optimizer step (gradient_accumulation_steps is {gas}), and {why}; "
            f"a checkpoint is saved and loaded only at an optimizer-step boundary. Call {what} after "
            f"{_micro_batches(remaining, 'more ')} (engine.step() calls), right after the step that advances "
            "engine.global_steps"
        )

    def _restore_scalars(self, scalars: dict[str, Any], *, load_lr_scheduler_states: bool) -> None:
        engine = scalars.get("engine") or {}
        self.global_steps = int(engine.get("global_steps", 0))
        self.global_samples = int(engine.get("global_samples", 0))
        self.skipped_steps = int(engine.get("skipped_steps", 0))
        self.micro_steps = int(engine.get("micro_steps", 0))
        state = scalars.get("lr_scheduler")
        if load_lr_scheduler_states and state and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state)
        if scalars.get("loss_scaler") and self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(scalars["loss_scaler"])
        self._forward_schedules.load_state_dict(scalars.get("forward_schedules") or {})
        load_sampler_state(getattr(self, "training_dataloader", None), scalars.get("data_sampler"))


def _micro_batches(count: int, adjective: str = "") -> str:
    return f"{count} {adjective}micro-batch{'' if count == 1 else 'es'}"

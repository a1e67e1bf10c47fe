"""The engine: where the parts meet. forward / backward / step, gradient accumulation, precision, logs.

Gradient scaling happens in exactly one place (docs/design.md D7): the ZeRO optimizer divides the summed
gradients by `world_size * gradient_accumulation_steps * loss_scale` once, at the optimizer step. The
division by the accumulation steps is left out when the user's backward was `engine.backward(loss,
scale_wrt_gas=False)` (Transformers does that; it divides the loss itself). So `loss.backward()` on the
engine's outputs and `engine.backward(loss)` produce the same step at every stage.
The logged loss is the mean over the global batch of the losses passed to `engine.backward`.

DeepSpeed counts the accumulation boundary from the public `micro_steps`; here it is counted from the last
optimizer step (`_window_micro_steps`), because a checkpoint restores `micro_steps` from a run that may have
used another accumulation count, and the first window after a load must still be `gradient_accumulation_steps`
micro-batches long. Without a load or an early `set_gradient_accumulation_boundary(True)` the two agree.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from slipstream.accelerator import get_accelerator
from slipstream.activation import recompute
from slipstream.comm import collectives
from slipstream.compat.engine_getters import EngineGetters
from slipstream.compat.engine_methods import DeepSpeedEngineMethods
from slipstream.config import notices
from slipstream.config.plan import EnginePlan
from slipstream.data.forward_kwargs import ForwardSchedules
from slipstream.engine import builders, compression_steps, eigenvalue_steps
from slipstream.engine.model_saving import ModelSaving
from slipstream.engine.monitor import StepFigures, step_events
from slipstream.engine.observe import CommsLog, step_observers, step_profiler
from slipstream.engine.parallel import setup_parallel
from slipstream.engine.post_training import PostTraining
from slipstream.engine.save_load import SaveLoad
from slipstream.monitor.writers import make_monitors
from slipstream.precision.buffers import cast_buffers
from slipstream.precision.reduce_dtypes import before_placement
from slipstream.utils.logging import log_rank0
from slipstream.utils.progress import Progress
from slipstream.utils.throughput import ThroughputTimer
from slipstream.zero.build import ZeroBuild, build_zero
from slipstream.zero.optimizer import DTYPES, ZeroOptimizer


class SlipstreamEngine(EngineGetters, ModelSaving, SaveLoad, PostTraining, DeepSpeedEngineMethods, nn.Module):
    """DeepSpeed's `DeepSpeedEngine`, for ZeRO stages 0-3. Build it with `slipstream.initialize`."""

    def __init__(self, model: nn.Module, plan: EnginePlan, client: builders.ClientObjects) -> None:
        """Built in named steps, in this order; the pipeline engine (pipe/engine.py) overrides some of them."""
        super().__init__()
        self._setup_basics(plan)
        moe = self._setup_parallel(model)
        zero = self._build_zero(model, moe)
        self._build_optimizer(zero, client.optimizer, client.model_parameters, moe)
        self._build_schedule_and_data(client.lr_scheduler, client.training_data, client.collate_fn)
        self._setup_observers()
        self._reset_counters()
        self._log_plan()

    # ---- construction steps ----
    def _setup_basics(self, plan: EnginePlan) -> None:
        """The plan, the resolved config, the collective timeout, this rank and its device."""
        self.plan = plan
        self.config = plan.resolved
        """DeepSpeed's `engine.config` (the resolved JSON, read by client code and stored in checkpoints); the
        engine itself reads only `plan`."""
        self.accelerator = get_accelerator()
        if plan.collective_timeout is not None:
            collectives.set_collective_timeout(plan.collective_timeout)
        self.global_rank = dist.get_rank()
        self.world_size = self.dp_world_size = dist.get_world_size()
        self.mp_world_size = 1
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = self.accelerator.device(self.accelerator.current_device())

    def _setup_parallel(self, model: nn.Module) -> Any:
        """The TP / SP layout (the model split over TP) and the data-parallel size; returns the MoE support
        (slipstream.moe.engine_support) when the model has MoE layers, else None."""
        plan = self.plan
        if plan.zero.stage == 3 and isinstance(model, nn.Module):
            builders.warn_if_materialised(model)
        self.parallel = setup_parallel(model, plan, self.device, self.global_rank)
        self.mp_world_size = self.parallel.tp_size
        self.sequence_parallel_size = self.parallel.sp_size
        self.dp_world_size = dist.get_world_size(self.parallel.data_group)  # ZeRO's group: data x sequence ranks
        moe = builders.moe_support(model)
        if moe is not None and (self.parallel.tp_size > 1 or self.parallel.sp_size > 1):
            raise ValueError(
                "MoE layers with tensor or sequence parallelism are not supported yet; use "
                "tensor_parallel.autotp_size 1 and sequence_parallel_size 1 with MoE"
            )
        return moe

    def _build_zero(self, model: nn.Module, moe: Any) -> ZeroBuild:
        """The model placed for its ZeRO stage over the data-parallel group (zero/build.py)."""
        zero = build_zero(
            before_placement(model, self.plan.precision, device_type=self.device.type),  # fp8 layers, reduce dtypes
            zero=self.plan.zero,
            precision=self.plan.precision,
            device=self.device,
            group=self.parallel.data_group,
            sources=None if moe is None else moe.expert_placement(model),
            unit_groups=None if moe is None else moe.unit_group,
        )
        self._adopt_module(zero)
        if moe is not None:
            self._param_names = moe.global_param_names(self.module, self._param_names)
            self._held_elsewhere = moe.names_held_elsewhere(self.module, self._param_names)
        return zero

    def _adopt_module(self, zero: ZeroBuild) -> None:
        """Take the placed module (and its stage-3 units), its buffers in data_types.buffer_dtype, and name its
        parameters."""
        cast_buffers(zero.module, self.plan.precision.buffer_dtype)
        self.module, self.zero_model = zero.module, zero.zero_model
        self._param_names = {id(p): n for n, p in self.module.named_parameters()}
        self._held_elsewhere: frozenset[str] = frozenset()

    def _build_optimizer(self, zero: ZeroBuild, optimizer: Any, model_parameters: Any, moe: Any) -> None:
        """The basic optimizer (the client's or the config's) and the ZeRO optimizer around it (None: no
        optimizer, inference)."""
        plan = self.plan
        model_parameters = self.parallel.adopt_client_params(optimizer, model_parameters)  # built before the TP split
        self.basic_optimizer = builders.make_basic_optimizer(self.module, plan, optimizer, model_parameters, moe=moe)
        notices.report_plan(plan, rank=self.global_rank)  # after a refused optimizer has raised
        self.optimizer: ZeroOptimizer | None = None
        if self.basic_optimizer is not None:
            group_for = None if moe is None else moe.group_for
            self.optimizer = zero.wrap(self.basic_optimizer, rank=self.global_rank, group_for=group_for)
            self.optimizer.param_names = self._param_names
            self.optimizer.at_boundary = lambda: self.is_gradient_accumulation_boundary() and not self._in_no_sync
            self.optimizer.model_parallel = self.parallel.norm_info(self.module)
            builders.check_host_memory(self.optimizer, rank=self.global_rank)
        builders.log_memory_plan(plan, self.module, world_size=self.dp_world_size, rank=self.global_rank)

    def _build_schedule_and_data(self, lr_scheduler: object, training_data: object, collate_fn: object) -> None:
        """The learning-rate scheduler, the fp16 loss scaler and the training data loader."""
        plan = self.plan
        self.lr_scheduler = builders.make_scheduler(plan, self.basic_optimizer, lr_scheduler)
        self.loss_scaler = builders.make_loss_scaler(plan.precision.loss_scale)
        self.training_dataloader = self.parallel.wrap_loader(
            builders.make_dataloader(plan, training_data, collate_fn, *self._loader_rank_and_size())
        )
        builders.tell_epoch_length(self.optimizer, self.training_dataloader, plan.batch.gradient_accumulation_steps)

    def _loader_rank_and_size(self) -> tuple[int, int]:
        """(which batch this rank reads, how many distinct batches there are)."""
        rank_and_size: tuple[int, int] = self.parallel.loader_rank_and_size()
        return rank_and_size

    def _setup_observers(self) -> None:
        """Monitors, the flops profiler, the comms logger, the progress line, activation checkpointing."""
        plan = self.plan
        self.monitors = make_monitors(plan.logging.monitor) if self.global_rank == 0 else []
        comms = plan.logging.comms_log
        self._step_profiler = step_profiler(plan, self.module, rank=self.global_rank)
        self._forward_schedules = ForwardSchedules(plan.schedules, plan.batch.train_batch_size)  # (data/)
        self._eigenvalue = eigenvalue_steps.EigenvalueSteps(plan, self.module, self.monitors, rank=self.global_rank)
        self.compression_scheduler = compression_steps.scheduler_for(plan, self.module)  # DeepSpeed's attribute
        self._autocast = builders.autocast_region(plan)  # the config's torch.autocast, if it has one
        self._comms_log = None if comms is None else CommsLog(comms, rank=self.global_rank)
        self._step_observers = step_observers(self._step_profiler, plan, self.module, rank=self.global_rank)
        self._progress = (
            Progress("train", unit="step", lines=False)  # a bar in a terminal; the step lines otherwise
            if self.global_rank == 0 and plan.logging.steps_per_print
            else None
        )
        if plan.activation_checkpointing is not None:
            recompute.configure_from_plan(plan.activation_checkpointing)

    def _reset_counters(self) -> None:
        """Step counters, the accumulation window, the loss totals and the timers."""
        self.global_steps = self.global_samples = self.micro_steps = self.skipped_steps = 0
        self._window_micro_steps = 0  # micro-batches stepped since the last optimizer step (or load)
        self._consecutive_skips = 0  # optimizer steps skipped in a row for non-finite gradients
        self._boundary_override: bool | None = None
        self._in_no_sync = False
        self._user_scaled_window = False
        self._scaled_this_micro = False
        # [sum of losses, count] of the current window, kept on the device: no host sync per micro-batch
        self._loss_totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        self._grad_norm: float | None = None
        self._step_applied = False
        self._last_loss: float | None = None
        self._window_started = time.perf_counter()
        self._timers: dict[str, float] = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        self.tput_timer = ThroughputTimer(
            batch_size=self.plan.batch.train_batch_size,
            enabled=self.plan.logging.throughput_timer,
            synchronize=get_accelerator().synchronize if self.plan.logging.throughput_synchronized else None,
        )
        """DeepSpeed's throughput timer: started by every forward, stopped by every step()
        (`engine.tput_timer.avg_samples_per_sec()`); the step line reports samples/s itself."""

    def _log_plan(self) -> None:
        builders.log_engine_plan(self.plan, world_size=self.world_size, rank=self.global_rank)

    def _optimizer_to_return(self) -> Any:
        """The optimizer `initialize()` returns: DeepSpeed wraps the basic optimizer only with ZeRO (stage >= 1)
        or mixed precision, and returns the client's (or the config's) own object otherwise. The engine
        always steps through its ZeRO optimizer (`engine.optimizer`); the basic one holds the hyperparameters."""
        precision = self.plan.precision
        unwrapped = (
            self.plan.zero.stage == 0 and precision.param_dtype == "fp32" and precision.grad_accum_dtype == "fp32"
        )
        return self.basic_optimizer if unwrapped else self.optimizer

    # ---- forward / backward ----
    def forward(self, *inputs: object, **kwargs: object) -> Any:
        started = time.perf_counter()
        self.tput_timer.start()
        dtype = DTYPES[self.plan.precision.param_dtype]
        if dtype != torch.float32:
            inputs, kwargs = builders.cast_floating((inputs, kwargs), dtype)
        kwargs = self._forward_schedules.add_to(kwargs, training=self.module.training, global_steps=self.global_steps)
        compression_steps.before_forward(self.compression_scheduler, self.global_steps, self.skipped_steps)
        with self._autocast.region():
            if self._step_profiler is None:
                output = self.module(*inputs, **kwargs)
            else:
                first = self._window_micro_steps == 0
                output = self._step_profiler.forward(lambda: self.module(*inputs, **kwargs), self.global_steps, first)
        self._timers["forward"] += time.perf_counter() - started
        return output

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of `loss` (loss scaling included); the step itself happens in `step()`."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or loss.grad_fn is None:
            raise ValueError(
                "engine.backward(loss) needs a scalar tensor that requires grad (the output of a loss "
                f"function); got {type(loss).__name__} with shape {getattr(loss, 'shape', None)}"
            )
        started = time.perf_counter()
        self._loss_totals[0] += loss.detach().double().reshape(())
        self._loss_totals[1] += 1
        if not scale_wrt_gas:
            self._user_scaled_window = True
        boundary = self.is_gradient_accumulation_boundary()  # eigenvalue: from the boundary micro-batch's loss
        self._eigenvalue.before_backward(loss, self.global_steps + 1, self.global_samples, boundary=boundary)
        self._backward_pass(self.scale(loss), retain_graph=retain_graph)  # compiled autograd after compile()
        self._timers["backward"] += time.perf_counter() - started
        gas = self.gradient_accumulation_steps() if scale_wrt_gas else 1
        return loss.detach() / gas

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` times the fp16 loss scale, for a PyTorch-style `engine.scale(loss).backward()`."""
        self._scaled_this_micro = True
        return loss if self.loss_scaler is None else self.loss_scaler.scale_loss(loss)

    # ---- accumulation ----
    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        return (self._window_micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self._boundary_override = bool(is_boundary)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient reduction for the backward passes inside (stages 0 and 1)."""
        if self.plan.zero.stage >= 2:
            raise RuntimeError(
                f"no_sync() is not available at ZeRO stage {self.plan.zero.stage}: gradients are "
                "reduced during backward; use gradient_accumulation_steps instead"
            )
        self._in_no_sync = True
        try:
            yield
        finally:
            self._in_no_sync = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad()
        self.module.zero_grad(set_to_none=set_to_none)

    # ---- the step ----
    def step(self, lr_kwargs: Mapping[str, object] | None = None) -> None:
        """Call after every micro-batch; the optimizer steps at the accumulation boundary."""
        if self._in_no_sync:
            raise RuntimeError(
                "engine.step() was called inside no_sync(); leave the no_sync() block for the last "
                "micro-batch of the accumulation window, then call step()"
            )
        if self.optimizer is None:
            raise RuntimeError(
                "engine.step() needs an optimizer: pass optimizer= to initialize() or add an "
                "'optimizer' section to the config"
            )
        started = time.perf_counter()
        self._check_fp16_scaled()
        self.optimizer.micro_step_done(reduce=True)
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            self._optimizer_step(lr_kwargs or {})
        self.tput_timer.stop(global_step=boundary)
        self.micro_steps += 1
        self._window_micro_steps = 0 if boundary else self._window_micro_steps + 1
        self._boundary_override = None
        self._scaled_this_micro = False
        self._timers["step"] += time.perf_counter() - started

    def _check_fp16_scaled(self) -> None:
        if self.loss_scaler is None or self._scaled_this_micro:
            return
        raise RuntimeError(
            "fp16 training with loss scaling: the backward of this micro-batch did not go through "
            "the loss scale. Use engine.backward(loss), or engine.scale(loss).backward() for a "
            "PyTorch-style backward; a plain loss.backward() would underflow fp16 gradients"
        )

    def _optimizer_step(self, lr_kwargs: Mapping[str, object]) -> None:
        assert self.optimizer is not None
        result = self.optimizer.step(grad_divisor=self._step_grad_divisor(), clip=self.plan.gradient_clipping)
        self._grad_norm = result.grad_norm
        self._step_applied = not result.overflow
        if result.overflow:
            self.skipped_steps += 1
        self._consecutive_skips = self._consecutive_skips + 1 if result.overflow else 0
        if self.loss_scaler is not None:
            self.loss_scaler.update(result.overflow)
            if result.overflow and self.loss_scaler.stuck():
                raise RuntimeError(builders.stuck_scale_message(self.loss_scaler, self.optimizer))
        limit = self.plan.precision.max_consecutive_skips
        if limit and self._consecutive_skips >= limit:
            raise RuntimeError(builders.skipped_steps_message(self._consecutive_skips, self.optimizer))
        compression_steps.after_optimizer_step(self.compression_scheduler, applied=not result.overflow)
        if not result.overflow and self.lr_scheduler is not None:
            self.lr_scheduler.step(**lr_kwargs)
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        for observer in self._step_observers:  # the flops profiler, an autotuning trial (may end the run)
            observer.step_ended(self.global_steps)
        self._finish_window()

    def _step_grad_divisor(self) -> float:
        """What the next optimizer step divides the summed gradients by (docs/design.md D7): data-parallel ranks
        x micro-batches of the window x the fp16 loss scale."""
        gas = 1 if self._user_scaled_window else self.gradient_accumulation_steps()
        loss_scale = 1.0 if self.loss_scaler is None else float(self.loss_scaler.scale)
        return self.dp_world_size * gas * loss_scale / (self.optimizer.pre_divided if self.optimizer else 1.0)

    def _finish_window(self) -> None:
        """Global mean loss of the batch (one scalar all-reduce); the monitors' events at every optimizer step, as
        DeepSpeed writes them; the progress line (and its window's figures) every `steps_per_print` steps."""
        totals = self._loss_totals
        if self.world_size > 1:
            collectives.all_reduce(totals)
        self._last_loss = float(totals[0] / totals[1]) if totals[1] > 0 else None
        totals.zero_()
        self._user_scaled_window = False
        every = self.plan.logging.steps_per_print
        if self._progress is not None:
            self._progress.advance(1, "" if self._last_loss is None else f"loss {self._last_loss:.4f}")
        loss_scale = None if self.loss_scaler is None else float(self.loss_scaler.scale)
        events: dict[str, float] = {}
        if self.monitors:  # rank 0's
            lr = self.get_lr()[0]
            events = step_events(lr=lr, loss=self._last_loss, grad_norm=self._grad_norm, loss_scale=loss_scale)
        if every and self.global_steps % every == 0:
            if self._comms_log is not None:
                self._comms_log.report()  # every rank resets its own counts; rank 0 prints
            if self.global_rank == 0:
                events.update(self._print_window(every, loss_scale))
        for monitor in self.monitors:
            monitor.write(events, self.global_samples)

    def _print_window(self, every: int, loss_scale: float | None) -> dict[str, float]:
        """Rank 0's progress line for the last `every` steps; returns the window's figures for the monitors."""
        elapsed = time.perf_counter() - self._window_started
        figures = StepFigures(
            step=self.global_steps,
            samples=self.global_samples,
            loss=self._last_loss,
            lr=self.get_lr()[0],
            grad_norm=self._grad_norm,
            loss_scale=loss_scale,
            samples_per_s=every * self.train_batch_size() / max(elapsed, 1e-9),
            step_time_s=elapsed / every,
            breakdown=dict(self._timers) if self.plan.logging.wall_clock_breakdown else None,
            memory_bytes=self.accelerator.memory_allocated() if self.monitors else None,
            rates=""
            if self._step_profiler is None
            else self._step_profiler.rates(
                elapsed / every,
                self.accelerator.device_name(),
                DTYPES[self.plan.precision.param_dtype],
            ),
        )
        log_rank0(figures.line(), rank=self.global_rank)
        if self.loss_scaler is not None and (report := self.loss_scaler.take_report()):
            log_rank0(report, rank=self.global_rank)
        self._window_started = time.perf_counter()
        self._timers = dict.fromkeys(self._timers, 0.0)
        return figures.window_events() if self.monitors else {}

    def get_sequence_parallel_group(self) -> dist.ProcessGroup | None:
        """The Ulysses group of this rank (`sequence_parallel_size`), None without sequence parallelism."""
        return None if self.parallel.topology is None else self.parallel.topology.sp_group

    # ---- figures ----
    def get_global_grad_norm(self) -> float | None:
        """The global L2 norm of the gradients before clipping, at the last optimizer step."""
        return self._grad_norm

    def was_step_applied(self) -> bool:
        return self._step_applied

    @property
    def last_loss(self) -> float | None:
        """Mean loss over the global batch of the last optimizer step (from engine.backward calls)."""
        return self._last_loss

    def get_lr(self) -> list[float]:
        source = self.basic_optimizer
        return [] if source is None else [float(g["lr"]) for g in source.param_groups]

    def train(self, mode: bool = True) -> SlipstreamEngine:
        self.module.train(mode)
        self.training = mode
        return self

    def comms_summary(self) -> str:
        """The comms logger's summary of the collectives since the last one (DeepSpeed's `comms_summary`)."""
        if self._comms_log is None:
            raise RuntimeError(
                "engine.comms_summary(): the comms logger is off; enable it with "
                '"comms_logger": {"enabled": true} in the config'
            )
        return self._comms_log.report()

    def destroy(self) -> None:
        if self._comms_log is not None:
            self._comms_log.close()
        if self._progress is not None:
            self._progress.finish()
        if self.optimizer is not None:
            self.optimizer.remove_hooks()
        if self.zero_model is not None:
            self.zero_model.detach_hooks()

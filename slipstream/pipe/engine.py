"""`PipelineEngine`: DeepSpeed's pipeline engine, the engine (engine/engine.py) with a pipeline schedule.
`initialize(model=PipelineModule(...))` builds it.

It is built by the engine's own construction steps (ZeRO through zero/build.py, the optimizer, scheduler,
monitors and notices), overriding four of them: the layout is the module's grid (no tensor or sequence
parallelism), ZeRO runs over the stage's data-parallel group with the pipeline's tied-weight and norm handling
(pipe/grads.py), every stage's copies of a tied weight start from the first sharing stage's, and the loader
reads by data-parallel index. ZeRO stage 3, fp16 loss scaling and ZenFlow are refused.

One `train_batch()` runs `gradient_accumulation_steps` micro-batches through the schedule the module names
(pipe/schedule.py) and takes one optimizer step through the engine's step (clipping, the scheduler, counters,
monitors, the step line). Gradients are averaged once, at the step, over data-parallel ranks x micro-batches
(docs/design.md D7). The returned loss is the mean over the micro-batches and the data-parallel ranks, the
same tensor on every rank. `forward`, `backward` and `step` raise, as in DeepSpeed: a pipeline trains only
through `train_batch`. Checkpoints keep the pipeline's own format (pipe/checkpoint.py).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from slipstream.comm import collectives
from slipstream.config.plan import EnginePlan
from slipstream.engine.builders import ClientObjects
from slipstream.engine.dataloader import RepeatingLoader
from slipstream.engine.engine import SlipstreamEngine
from slipstream.engine.parallel import ParallelSetup
from slipstream.engine.save_load import LoadRequest, SaveRequest
from slipstream.pipe.exchange import Exchanger
from slipstream.pipe.grads import pipeline_optimizer_class
from slipstream.pipe.module import PipelineError, PipelineModule
from slipstream.pipe.runtime import StageRunner
from slipstream.pipe.schedule import Action, actions_for
from slipstream.pipe.table import stage_table
from slipstream.utils.errors import ArgumentTypeError
from slipstream.utils.logging import get_logger, log_rank0
from slipstream.zero.build import ZeroBuild, build_zero

_ONLY_TRAIN_BATCH = "Only train_batch() is accessible in pipeline mode (DeepSpeed's rule): call engine.train_batch()"


def _check_supported(plan: EnginePlan) -> None:
    """Refuse what a pipeline does not train: ZeRO stage 3, fp16 loss scaling and ZenFlow."""
    if plan.zero.stage == 3:
        raise PipelineError(
            "ZeRO stage 3 with a PipelineModule is not supported (each stage already holds only its layers); "
            "use zero_optimization.stage 0, 1 or 2"
        )
    if plan.precision.loss_scale is not None:
        raise PipelineError("fp16 with loss scaling is not supported with a PipelineModule yet; use bf16 or fp32")
    if plan.zero.zenflow is not None:
        raise PipelineError(
            "zero_optimization.zenflow with a PipelineModule is not supported; remove the zenflow section"
        )


class PipelineEngine(SlipstreamEngine):
    """Trains a PipelineModule; built by `slipstream.initialize`. A `DeepSpeedEngine`, as in DeepSpeed."""

    module: PipelineModule

    def __init__(self, module: PipelineModule, plan: EnginePlan, client: ClientObjects) -> None:
        _check_supported(plan)
        super().__init__(module, plan, client)
        self.micro_batches = self.gradient_accumulation_steps()
        self.data_iterator: Iterator[Any] | None = None
        self.batch_fn: Callable[[Any], Any] | None = None
        self.has_attention_mask = False
        self._force_grad_boundary = False
        exchanger = Exchanger(num_virtual=module.num_virtual_stages, dynamic=module.dynamic_shape, device=self.device)
        self._runner = StageRunner(
            module, exchanger, ranks_of_stage=self.grid.stage_to_global, after_backward=self._after_backward
        )
        self._actions: dict[tuple[str, int], Any] = {}

    # ---- construction steps (engine/engine.py) ----
    def _setup_parallel(self, model: nn.Module) -> Any:
        """The module's grid: stages x data-parallel replicas; no tensor or sequence parallelism, no MoE."""
        assert isinstance(model, PipelineModule)
        self.parallel = ParallelSetup(None, None)
        self.grid = model.mpu()
        self.stage_id, self.num_stages = model.stage_id, model.num_stages
        self.dp_world_size, self.dp_rank = self.grid.data_parallel_size, self.grid.data_parallel_id
        self.sequence_parallel_size = 1
        if self.plan.pipeline.activation_checkpoint_interval > 0:  # the config seeds the module's interval (DeepSpeed)
            model.activation_checkpoint_interval = self.plan.pipeline.activation_checkpoint_interval
        return None

    def _build_zero(self, model: nn.Module, moe: object) -> ZeroBuild:
        """The stage placed over its data-parallel group, its optimizer class with the pipeline's tied weights
        and norm; then every copy of a tied weight takes the first sharing stage's values."""
        zero = build_zero(
            model,
            zero=self.plan.zero,
            precision=self.plan.precision,
            device=self.device,
            group=self.grid.dp_group,
            extend=pipeline_optimizer_class,
        )
        self._adopt_module(zero)
        with torch.no_grad():
            for _key, param, group, ranks in self.module.tied_parameters():
                collectives.broadcast(param.data, src=ranks[0], group=group)
        return zero

    def _build_optimizer(self, zero: ZeroBuild, optimizer: object, model_parameters: object, moe: object) -> None:
        super()._build_optimizer(zero, optimizer, model_parameters, moe)
        if self.optimizer is None:
            return
        module = self.module
        tied = [(p, group, module.is_tied_owner(key)) for key, p, group, _ in module.tied_parameters()]
        self.optimizer.attach_pipeline(  # type: ignore[attr-defined]
            tied=tied, pipe_group=self.grid.pp_group, pipe_size=self.num_stages
        )

    def _loader_rank_and_size(self) -> tuple[int, int]:
        return self.dp_rank, self.dp_world_size

    def _log_plan(self) -> None:
        super()._log_plan()
        log_rank0(stage_table(self.module, self.plan, dp=self.dp_world_size), rank=self.global_rank)

    def _optimizer_to_return(self) -> Any:
        """DeepSpeed's pipeline engine hands back its own (ZeRO) optimizer, whatever the stage and precision."""
        return self.optimizer

    # ---- DeepSpeed's pipeline surface ----
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.module.stage_owner(self.module.num_virtual_stages - 1)

    def get_pipeline_parallel_rank(self) -> int:
        return self.stage_id

    def get_data_parallel_rank(self) -> int:
        """This rank's index among its stage's data-parallel replicas (the grid's)."""
        return self.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.dp_world_size

    @property
    def mpu(self) -> Any:
        """The module's grid, DeepSpeed's model-parallel unit for a pipeline."""
        return self.grid

    def set_has_attention_mask(self, value: bool) -> None:
        """DeepSpeed's flag for an attention mask among the activations; the exchange here sends every tensor
        (bool ones included) with its dtype, so it changes nothing."""
        if not isinstance(value, bool):
            raise ArgumentTypeError(f"set_has_attention_mask(value): expected True or False, got {value!r}")
        self.has_attention_mask = value

    def set_dataloader(self, loader: Any) -> None:
        """Train from `loader` (first and last stages, the ones that read data)."""
        if self.is_first_stage() or self.is_last_stage():
            self.training_dataloader = loader
            self.data_iterator = iter(loader)

    def set_dataiterator(self, iterator: Iterator[object]) -> None:
        """Train from `iterator` (first and last stages), in place of the engine's loader."""
        if self.is_first_stage() or self.is_last_stage():
            self.training_dataloader = None
            self.data_iterator = iterator

    def set_batch_fn(self, fn: Callable[[Any], Any]) -> None:
        self.batch_fn = fn

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch by changing the micro-batches per train_batch (DeepSpeed's rule)."""
        super().set_train_batch_size(train_batch_size)
        self.micro_batches = self.gradient_accumulation_steps()

    def is_gradient_accumulation_boundary(self) -> bool:
        """True only while train_batch() takes its optimizer step (DeepSpeed's pipeline rule)."""
        return self._force_grad_boundary

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, torch.Tensor]:
        """The whole pipeline's state dict on rank 0 (each stage's layers from its first data-parallel rank,
        under the module's names, the same at every stage count); an empty dict on the other ranks."""
        state = {}
        if self.dp_rank == 0:
            own = self.module_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)
            state = {name: tensor.detach().to("cpu", copy=True) for name, tensor in own.items()}
        parts: list[Any] | None = [None] * self.world_size if self.global_rank == 0 else None
        dist.gather_object(state, parts, dst=0)
        whole: dict[str, torch.Tensor] = OrderedDict()
        for part in parts or []:
            whole.update(part)
        return whole

    def get_additional_losses(self) -> dict[str, torch.Tensor] | None:
        """The losses a model reports besides its main one, per batch; a PipelineModule's loss_fn returns only
        the main one, so None (DeepSpeed's value without them)."""
        return None

    def reset_activation_shape(self) -> None:
        """Nothing to reset: every transfer's shapes travel with it, or are resent when they change."""

    def log_for_device(self, *msg: object) -> None:
        """`msg` in the debug log, tagged with this rank's stage, data-parallel index and step."""
        text = " ".join(str(m) for m in msg)
        get_logger().debug(
            "RANK=%d PIPE-ID=%d DATA-ID=%d STEP-ID=%d :: %s",
            self.global_rank,
            self.stage_id,
            self.dp_rank,
            self.global_steps,
            text,
        )

    def tput_log(self, *msg: object) -> None:
        """`msg` on rank 0 at the steps the step line is printed (`steps_per_print`)."""
        every = self.plan.logging.steps_per_print
        if every and self.global_steps % every == 0:
            log_rank0(" ".join(str(m) for m in msg), rank=self.global_rank)

    def forward(self, *args: object, **kwargs: object) -> Any:
        raise PipelineError(_ONLY_TRAIN_BATCH)

    def backward(self, *args: object, **kwargs: object) -> Any:
        raise PipelineError(_ONLY_TRAIN_BATCH)

    def step(self, *args: object, **kwargs: object) -> Any:
        raise PipelineError(_ONLY_TRAIN_BATCH)

    # ---- batches ----
    def _training_iterator(self) -> Iterator[Any] | None:
        """What train_batch reads on the first and last stages (None on the others): the iterator set, or the
        engine's loader, restarted at its end."""
        if not (self.is_first_stage() or self.is_last_stage()):
            return None
        if self.data_iterator is None:
            if self.training_dataloader is None:
                raise PipelineError(
                    "train_batch() needs data: pass data_iter=, call set_dataiterator(), or give "
                    "initialize(training_data=...)"
                )
            self.data_iterator = iter(RepeatingLoader(self.training_dataloader))
        return self.data_iterator

    def _read_micro_batches(self, iterator: Iterator[object] | None) -> tuple[list[Any], list[Any]]:
        """(inputs, labels) per micro-batch; only the first and last stages read data (as in DeepSpeed)."""
        if iterator is None or not (self.is_first_stage() or self.is_last_stage()):
            return [None] * self.micro_batches, [None] * self.micro_batches
        inputs, labels = [], []
        for _ in range(self.micro_batches):
            batch = next(iterator)
            if self.batch_fn is not None:
                batch = self.batch_fn(batch)
            if not isinstance(batch, (tuple, list)) or len(batch) != 2:
                raise PipelineError(f"each micro-batch must be (inputs, labels); got {type(batch).__name__}")
            inputs.append(_to_device(batch[0], self.device))
            labels.append(_to_device(batch[1], self.device))
        return inputs, labels

    def _schedule(self, name: str) -> Any:
        key = (name, self.micro_batches)
        if key not in self._actions:
            if name == "eval":
                order = [(v, m) for m in range(self.micro_batches) for v in self.module.local_virtual]
                self._actions[key] = [Action(v, "F", m) for v, m in order]
            else:
                self._actions[key] = actions_for(
                    self.module.schedule,
                    rank=self.stage_id,
                    stages=self.num_stages,
                    chunks=self.module.stage_chunks,
                    micros=self.micro_batches,
                )
        return self._actions[key]

    def _after_backward(self, weights: list[torch.Tensor] | None) -> None:
        if self.optimizer is None:
            return
        if weights is not None:
            self.optimizer.take_grads(weights)  # type: ignore[attr-defined]
        self.optimizer.micro_step_done(reduce=True)

    def train_batch(self, data_iter: Iterator[object] | None = None) -> torch.Tensor:
        """One batch (gradient_accumulation_steps micro-batches) and one optimizer step (the engine's); the
        mean loss over the micro-batches and data-parallel ranks."""
        if self.optimizer is None:
            raise PipelineError("train_batch() needs an optimizer: pass optimizer= or an 'optimizer' config section")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train()
        self.tput_timer.start()
        inputs, labels = self._read_micro_batches(self._training_iterator())
        losses = self._runner.run(self._schedule("train"), inputs, labels, train=True)
        for loss in losses:  # the last stage's; the step's window all-reduces them over every rank
            self._loss_totals[0] += loss.detach().double().sum()
            self._loss_totals[1] += 1
        self._force_grad_boundary = True
        try:
            self._optimizer_step({})
        finally:
            self._force_grad_boundary = False
        self.tput_timer.stop(global_step=True)
        self.micro_steps += self.micro_batches
        return torch.tensor(float("nan") if self._last_loss is None else self._last_loss, device=self.device)

    def _mean_over_batch(self, losses: list[torch.Tensor]) -> torch.Tensor:
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        if losses:
            total += sum(loss.detach().double().sum() for loss in losses)
        collectives.all_reduce(total)
        return (total / (self.dp_world_size * self.micro_batches)).float().reshape(())

    def eval_batch(
        self,
        data_iter: Iterator[object],
        return_logits: bool = False,
        compute_loss: bool = True,
        reduce_output: str | None = "avg",
        bcast_loss: bool = True,
        num_micro_batches: int | None = None,
    ) -> Any:
        """Forward only over one batch (`num_micro_batches`, default gradient_accumulation_steps). With
        `compute_loss` (and a loss_fn), the loss ('avg' over micro-batches and data-parallel ranks, on every
        rank, or on the last stage only without `bcast_loss`; None: the list of per-micro-batch losses, last
        stage only); `return_logits`: also the last stage's outputs (None on other stages)."""
        saved_micros = self.micro_batches
        self.micro_batches = int(num_micro_batches or saved_micros)
        try:
            return self._eval(data_iter, return_logits, compute_loss, reduce_output, bcast_loss)
        finally:
            self.micro_batches = saved_micros

    @torch.no_grad()
    def _eval(
        self, data_iter: Any, return_logits: bool, compute_loss: bool, reduce_output: str | None, bcast_loss: bool
    ) -> Any:
        self.module.eval()
        inputs, labels = self._read_micro_batches(self._training_iterator() if data_iter is None else data_iter)
        saved_loss = self.module.loss_fn
        if not compute_loss:
            self.module.loss_fn = None
        logits: list[Any] = []
        try:
            if return_logits and compute_loss and saved_loss is not None:
                self.module.loss_fn = _Capture(saved_loss, logits)
            outputs = self._runner.run(self._schedule("eval"), inputs, labels, train=False)
        finally:
            self.module.loss_fn = saved_loss
        if reduce_output == "avg" and compute_loss:
            result: Any = self._mean_over_batch(outputs)
            result = result if bcast_loss or self.is_last_stage() else None
        else:
            result = outputs if self.is_last_stage() else None
        if return_logits:
            return result, (logits or outputs) if self.is_last_stage() else None
        return result

    # ---- checkpoints (the pipeline's format, pipe/checkpoint.py) ----
    def _save_checkpoint(self, save_dir: str, tag: str | None, request: SaveRequest) -> None:
        """Every rank's slices of its stage's trainable parameters and their optimizer state (frozen parameters
        are never in this format, so `request.exclude_frozen` changes nothing)."""
        from slipstream.pipe.checkpoint import save_pipeline

        tag = tag or f"global_step{self.global_steps}"
        save_pipeline(self, os.fspath(save_dir), tag, dict(request.client_state), save_latest=request.save_latest)

    def _load_checkpoint(self, load_dir: str, tag: str | None, request: LoadRequest) -> tuple[Any, Any]:
        """Load a pipeline checkpoint saved at any stage count and data-parallel degree; (path, client_state)."""
        from slipstream.pipe.checkpoint import load_pipeline

        return load_pipeline(self, os.fspath(load_dir), tag, load_optimizer_states=request.optimizer_states)


class _Capture:
    """A loss function that also keeps the outputs it was given (eval_batch with return_logits)."""

    def __init__(self, loss_fn: Callable[..., object], into: list[object]) -> None:
        self.loss_fn, self.into = loss_fn, into

    def __call__(self, outputs: object, labels: object) -> Any:
        self.into.append(outputs)
        return self.loss_fn(outputs, labels)


def _to_device(tree: object, device: torch.device) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, (tuple, list)):
        return type(tree)(_to_device(t, device) for t in tree)
    if isinstance(tree, dict):
        return {k: _to_device(v, device) for k, v in tree.items()}
    return tree

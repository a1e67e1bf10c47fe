"""`PipelineEngine`: DeepSpeed's pipeline engine. `initialize(model=PipelineModule(...))` builds it.

One `train_batch()` runs `gradient_accumulation_steps` micro-batches through the schedule the module names
(pipe/schedule.py) and takes one optimizer step: the stage's ZeRO optimizer (stages 0, 1 or 2) over the
stage's data-parallel group, with tied-weight gradients and the global norm handled across stages
(pipe/grads.py). Gradients are averaged once, at the step, over data-parallel ranks x micro-batches
(docs/design.md D7). The returned loss is the mean over the micro-batches and the data-parallel ranks, the
same tensor on every rank. `forward`, `backward` and `step` raise, as in DeepSpeed: a pipeline trains only
through `train_batch`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from slipstream.accelerator import get_accelerator
from slipstream.comm import collectives
from slipstream.config import notices
from slipstream.config.plan import EnginePlan
from slipstream.offload.choose import policy_for
from slipstream.pipe.exchange import Exchanger
from slipstream.pipe.grads import pipeline_optimizer_class
from slipstream.pipe.module import PipelineError, PipelineModule
from slipstream.pipe.runtime import StageRunner
from slipstream.pipe.schedule import actions_for
from slipstream.pipe.table import stage_table
from slipstream.utils.logging import log_rank0
from slipstream.zero.build import STAGES, check_optimizer_kind
from slipstream.zero.optimizer import DTYPES, ZeroOptimizer

_ONLY_TRAIN_BATCH = "Only train_batch() is accessible in pipeline mode (DeepSpeed's rule): call engine.train_batch()"


def _check_supported(plan: EnginePlan) -> None:
    """Refuse what a pipeline does not train: ZeRO stage 3 and fp16 loss scaling."""
    if plan.zero.stage == 3:
        raise PipelineError(
            "ZeRO stage 3 with a PipelineModule is not supported (each stage already holds only its layers); "
            "use zero_optimization.stage 0, 1 or 2"
        )
    if plan.precision.loss_scale is not None:
        raise PipelineError("fp16 with loss scaling is not supported with a PipelineModule yet; use bf16 or fp32")


class PipelineEngine(nn.Module):
    """Trains a PipelineModule; built by `slipstream.initialize`."""

    def __init__(
        self,
        module: PipelineModule,
        plan: EnginePlan,
        *,
        make_optimizer: Callable[[nn.Module], torch.optim.Optimizer | None],
        make_scheduler: Callable[[Any], Any],
        make_dataloader: Callable[[int, int], Any],
        repeat: Callable[[Any], Any] = iter,
    ) -> None:
        super().__init__()
        _check_supported(plan)
        self.plan, self.config = plan, plan.resolved
        self.module = module
        self.grid = module.mpu()
        self.global_rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.stage_id, self.num_stages = module.stage_id, module.num_stages
        self.dp_world_size, self.dp_rank = self.grid.data_parallel_size, self.grid.data_parallel_id
        self.micro_batches = plan.batch.gradient_accumulation_steps
        self.device = get_accelerator().device(get_accelerator().current_device())
        notices.report_plan(plan, rank=self.global_rank)
        if plan.pipeline.activation_checkpoint_interval > 0:  # the config seeds the module's interval (DeepSpeed)
            module.activation_checkpoint_interval = plan.pipeline.activation_checkpoint_interval
        self._place()
        self.basic_optimizer = make_optimizer(module)
        self.optimizer = self._stage_optimizer(self.basic_optimizer)
        self.lr_scheduler = make_scheduler(self.basic_optimizer)
        self.training_dataloader = make_dataloader(self.dp_rank, self.dp_world_size)
        self._repeat = repeat
        """Wraps the training loader so it restarts at its end (the engine's RepeatingLoader, from api.py)."""
        self.data_iterator: Iterator[Any] | None = None
        self.batch_fn: Callable[[Any], Any] | None = None
        exchanger = Exchanger(
            num_virtual=module.num_virtual_stages,
            dynamic=module.dynamic_shape,
            device=self.device,
        )
        self._runner = StageRunner(
            module, exchanger, ranks_of_stage=self.grid.stage_to_global, after_backward=self._after_backward
        )
        self.global_steps = self.global_samples = self.micro_steps = 0
        self._grad_norm: float | None = None
        self._last_loss: torch.Tensor | None = None
        self._actions: dict[tuple[str, int], Any] = {}
        log_rank0(stage_table(module, plan, dp=self.dp_world_size), rank=self.global_rank)

    def _stage_optimizer(self, basic_optimizer: torch.optim.Optimizer | None) -> ZeroOptimizer | None:
        """The stage's ZeRO optimizer around the client's, over the stage's data-parallel group, with the tied
        weights and the pipeline group attached (None without a client optimizer)."""
        if basic_optimizer is None:
            return None
        plan, module = self.plan, self.module
        check_optimizer_kind(basic_optimizer, plan.zero)
        cls = pipeline_optimizer_class(STAGES[plan.zero.stage])
        optimizer = cls(
            basic_optimizer,
            zero=plan.zero,
            precision=plan.precision,
            offload=policy_for(plan.zero.offload_optimizer, rank=self.global_rank),
            group=self.grid.dp_group,
        )
        tied = [(p, group, module.is_tied_owner(key)) for key, p, group, _ in module.tied_parameters()]
        optimizer.attach_pipeline(  # type: ignore[attr-defined]
            tied=tied,
            pipe_group=self.grid.pp_group,
            pipe_size=self.num_stages,
        )
        optimizer.param_names = {id(p): n for n, p in module.named_parameters()}
        return optimizer

    def _place(self) -> None:
        """Parameters to the device and dtype; each stage's replicas take their first rank's values, and every
        copy of a tied weight takes the first sharing stage's."""
        dtype = DTYPES[self.plan.precision.param_dtype]
        self.module.to(self.device)
        if dtype != torch.float32:
            self.module.to(dtype)
        with torch.no_grad():
            if self.dp_world_size > 1:
                for tensor in [*self.module.parameters(), *self.module.buffers()]:
                    collectives.broadcast(tensor.data, src=self.grid.dp_ranks[0], group=self.grid.dp_group)
            for _key, param, group, ranks in self.module.tied_parameters():
                collectives.broadcast(param.data, src=ranks[0], group=group)

    # ---- DeepSpeed's surface ----
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.module.stage_owner(self.module.num_virtual_stages - 1)

    def set_dataiterator(self, iterator: Iterator[Any]) -> None:
        self.data_iterator = iterator

    def set_batch_fn(self, fn: Callable[[Any], Any]) -> None:
        self.batch_fn = fn

    def train_batch_size(self) -> int:
        return self.plan.batch.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.plan.batch.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.micro_batches

    def get_global_grad_norm(self) -> float | None:
        return self._grad_norm

    def get_lr(self) -> list[float]:
        return [] if self.basic_optimizer is None else [float(g["lr"]) for g in self.basic_optimizer.param_groups]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError(_ONLY_TRAIN_BATCH)

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError(_ONLY_TRAIN_BATCH)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError(_ONLY_TRAIN_BATCH)

    # ---- batches ----
    def _next_micro_batches(self, data_iter: Iterator[Any] | None) -> tuple[list[Any], list[Any]]:
        """(inputs, labels) per micro-batch; only the first and last stages read data (as in DeepSpeed)."""
        if data_iter is not None:
            self.data_iterator = data_iter
        needs = self.is_first_stage() or self.is_last_stage()
        if not needs:
            return [None] * self.micro_batches, [None] * self.micro_batches
        if self.data_iterator is None:
            if self.training_dataloader is None:
                raise PipelineError(
                    "train_batch() needs data: pass data_iter=, call set_dataiterator(), or give "
                    "initialize(training_data=...)"
                )
            self.data_iterator = iter(self._repeat(self.training_dataloader))
        inputs, labels = [], []
        for _ in range(self.micro_batches):
            batch = next(self.data_iterator)
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
                from slipstream.pipe.schedule import Action

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

    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """One batch (gradient_accumulation_steps micro-batches) and one optimizer step; the mean loss."""
        if self.optimizer is None:
            raise PipelineError("train_batch() needs an optimizer: pass optimizer= or an 'optimizer' config section")
        self.module.train()
        inputs, labels = self._next_micro_batches(data_iter)
        losses = self._runner.run(self._schedule("train"), inputs, labels, train=True)
        result = self.optimizer.step(
            grad_divisor=self.dp_world_size * self.micro_batches, clip=self.plan.gradient_clipping
        )
        self._grad_norm = result.grad_norm
        if not result.overflow and self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.global_steps += 1
        self.micro_steps += self.micro_batches
        self.global_samples += self.train_batch_size()
        self._last_loss = self._mean_over_batch(losses)
        every = self.plan.logging.steps_per_print
        if every and self.global_steps % every == 0:
            log_rank0(
                f"pipeline step {self.global_steps}: loss {float(self._last_loss):.6g}, grad norm "
                f"{self._grad_norm:.4g}",
                rank=self.global_rank,
            )
        return self._last_loss

    def _mean_over_batch(self, losses: list[torch.Tensor]) -> torch.Tensor:
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        if losses:
            total += sum(loss.detach().double().sum() for loss in losses)
        collectives.all_reduce(total)
        return (total / (self.dp_world_size * self.micro_batches)).float().reshape(())

    def eval_batch(
        self,
        data_iter: Iterator[Any],
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
        inputs, labels = self._next_micro_batches(data_iter)
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

    # ---- checkpoints ----
    def save_checkpoint(
        self,
        save_dir: str,
        tag: str | None = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
    ) -> bool:
        from slipstream.pipe.checkpoint import save_pipeline

        save_pipeline(
            self,
            os.fspath(save_dir),
            tag or f"global_step{self.global_steps}",
            client_state or {},
            save_latest=save_latest,
        )
        return True

    def load_checkpoint(
        self,
        load_dir: str,
        tag: str | None = None,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        **_: Any,
    ) -> tuple[str | None, dict[str, Any]]:
        from slipstream.pipe.checkpoint import load_pipeline

        return load_pipeline(self, os.fspath(load_dir), tag, load_optimizer_states=load_optimizer_states)

    def destroy(self) -> None:
        if self.optimizer is not None:
            self.optimizer.remove_hooks()


class _Capture:
    """A loss function that also keeps the outputs it was given (eval_batch with return_logits)."""

    def __init__(self, loss_fn: Callable[..., Any], into: list[Any]) -> None:
        self.loss_fn, self.into = loss_fn, into

    def __call__(self, outputs: Any, labels: Any) -> Any:
        self.into.append(outputs)
        return self.loss_fn(outputs, labels)


def _to_device(tree: Any, device: torch.device) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, (tuple, list)):
        return type(tree)(_to_device(t, device) for t in tree)
    if isinstance(tree, dict):
        return {k: _to_device(v, device) for k, v in tree.items()}
    return tree

"""How the engine's parts are made from the plan: module placement, optimizers, ZeRO stage, scheduler, data.

Each function takes the piece of the plan it needs; the engine calls them once, in `__init__`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from slipstream.accelerator import get_accelerator
from slipstream.config.plan import EnginePlan, LossScalePlan
from slipstream.engine.dataloader import make_training_dataloader
from slipstream.offload.policy import host_available_bytes
from slipstream.precision import NoAutocast, apply_state_dtype, forward_region
from slipstream.utils.errors import ArgumentTypeError
from slipstream.utils.logging import get_logger, log_rank0, warn_once
from slipstream.zero.optimizer import ZeroOptimizer


@dataclasses.dataclass(frozen=True, slots=True)
class ClientObjects:
    """What the client handed `initialize()` besides the model and the config (each None when not given), in
    the order the fields are listed: the engine builds the optimizer, scheduler and data loader from them."""

    optimizer: object = None
    model_parameters: object = None
    lr_scheduler: object = None
    training_data: object = None
    collate_fn: object = None


def warn_if_materialised(model: nn.Module) -> None:
    """Stage 3 on a model built without zero.Init: every rank held the whole model once (say so, with numbers)."""
    from slipstream.planner import materialised_warning, should_warn_materialised
    from slipstream.zero.stage3.sharded_param import ShardedParameter

    whole = sum(p.numel() for p in model.parameters() if not isinstance(p, ShardedParameter))
    if should_warn_materialised(whole, dist.get_world_size()):
        warn_once("z3-materialised", materialised_warning(whole, dist.get_world_size()))


def moe_support(model: object) -> Any:
    """slipstream.moe.engine_support when the model has MoE layers (their groups made), else None."""
    if not isinstance(model, nn.Module) or "slipstream.moe" not in sys.modules:
        return None  # no MoE layer can exist before slipstream.moe is imported
    from slipstream.moe import engine_support

    if not engine_support.has_experts(model):
        return None
    engine_support.prepare(model)
    return engine_support


def autocast_region(plan: EnginePlan) -> NoAutocast:
    """The region the engine's forward runs in (slipstream/precision/autocast.py)."""
    return forward_region(plan.precision.autocast, device_type=get_accelerator().device_name())


def make_basic_optimizer(
    module: nn.Module, plan: EnginePlan, client: Any, model_parameters: Any, *, moe: Any = None
) -> torch.optim.Optimizer | None:
    """The client optimizer (instance or callable), or the one the config names, or None (inference). With MoE
    layers (`moe`: slipstream.moe.engine_support) expert parameters get param groups of their own.

    A client optimizer wins over an `optimizer` config section, with a warning naming both (DeepSpeed uses
    the client's silently)."""
    params = (
        list(model_parameters) if model_parameters is not None else [p for p in module.parameters() if p.requires_grad]
    )
    if moe is not None:
        params = moe.moe_param_groups(params)
        if isinstance(client, torch.optim.Optimizer):
            moe.resplit_optimizer(client)
    if client is not None:
        is_instance = isinstance(client, torch.optim.Optimizer)
        if not is_instance and not callable(client):
            raise ArgumentTypeError(
                f"initialize(optimizer=...) must be a torch.optim.Optimizer or a callable returning one; "
                f"got {type(client).__name__}"
            )
        optimizer = client if is_instance else client(params)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ArgumentTypeError(
                f"initialize(optimizer=...) must be a torch.optim.Optimizer or a callable returning one; "
                f"the callable returned {type(optimizer).__name__}"
            )
        if plan.optimizer is not None:
            warn_once(
                f"client-and-config-optimizer:{type(optimizer).__name__}:{plan.optimizer.name}",
                f"slipstream: both initialize(optimizer=...) ({type(optimizer).__name__}) and the config's "
                f"'optimizer' section (type {plan.optimizer.name!r}) were given; using the client's "
                f"{type(optimizer).__name__}, as DeepSpeed does. Remove one of them to silence this warning",
            )
    elif plan.optimizer is None:
        return None
    else:
        from slipstream.engine.optimizers import build_optimizer

        if plan.optimizer.name == "muon":  # DeepSpeed tags the model's parameters use_muon before building
            from slipstream.optim.muon import tag_muon_params

            tag_muon_params(module)
        optimizer = build_optimizer(plan.optimizer, params, on_host=plan.zero.offload_optimizer.on_host)
    apply_state_dtype(optimizer, plan.precision)  # low-precision masters: the moments' dtype, or a refusal
    return optimizer


def check_host_memory(optimizer: ZeroOptimizer, *, rank: int) -> None:
    """With offload: say how much host memory it needs, and stop with numbers if the host clearly lacks it."""
    per_rank = optimizer.host_bytes_needed()
    if not per_rank:
        return
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")))
    need, available = per_rank * local_ranks, host_available_bytes()
    log_rank0(
        f"offload: host memory needed {per_rank / 2**30:.3f} GiB per rank, {need / 2**30:.3f} GiB for "
        f"{local_ranks} local rank(s); available {available / 2**30:.3f} GiB",
        rank=rank,
    )
    if available and need > available:
        raise RuntimeError(
            f"optimizer offload needs {need / 2**30:.2f} GiB of host memory on this node "
            f"({local_ranks} ranks x {per_rank / 2**30:.2f} GiB) but only {available / 2**30:.2f} GiB is "
            "available; use fewer ranks per node, a higher ZeRO stage, or a larger host"
        )


def log_memory_plan(plan: EnginePlan, module: nn.Module, *, world_size: int, rank: int) -> None:
    """Rank 0: one line with the planner's prediction for this run (slipstream/planner)."""
    if rank != 0:
        return
    from slipstream.planner import engine_line

    try:
        line = engine_line(
            plan=plan, model=module, world_size=world_size, gpus_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        )
    except (ValueError, TypeError, NotImplementedError) as exc:  # an estimate must never stop a run
        line = f"memory plan: not available for this model ({exc})"
    log_rank0(line, rank=rank)


def make_scheduler(plan: EnginePlan, optimizer: torch.optim.Optimizer | None, client: object) -> Any:
    """The client's scheduler (instance, or callable of the optimizer), else the config's, else None. A client
    scheduler wins over a `scheduler` config section, with a warning naming both (DeepSpeed: silently)."""
    if client is not None:
        if plan.scheduler is not None:
            warn_once(
                f"client-and-config-scheduler:{type(client).__name__}:{plan.scheduler.name}",
                f"slipstream: both initialize(lr_scheduler=...) ({type(client).__name__}) and the config's "
                f"'scheduler' section (type {plan.scheduler.name!r}) were given; using the client's, as "
                "DeepSpeed does. Remove one of them to silence this warning",
            )
        if callable(client) and not hasattr(client, "step"):
            return client(optimizer)
        if getattr(client, "optimizer", optimizer) is not optimizer:
            # DeepSpeed means to assert here, but its check is dead on torch >= 2 (schedulers are no longer
            # `_LRScheduler`s), so its callers get the object back: so do ours, with a warning
            warn_once(
                f"foreign-scheduler:{id(client)}",
                f"slipstream: initialize(lr_scheduler=<{type(client).__name__} object>) is bound to another "
                "optimizer than the engine's, so its learning rates do not reach training; pass lr_scheduler as "
                "a callable (optimizer -> scheduler), or build it on the optimizer object you pass",
            )
        return client
    if plan.scheduler is None or optimizer is None:
        return None
    from slipstream.engine.optimizers import build_scheduler

    return build_scheduler(plan.scheduler, optimizer)


def make_loss_scaler(plan: LossScalePlan | None) -> Any:
    if plan is None:
        return None
    from slipstream.zero.loss_scaler import make_loss_scaler as build

    return build(plan)


def make_dataloader(plan: EnginePlan, data: Any, collate_fn: Any, rank: int, world_size: int) -> Any:
    if data is None:
        return None
    if plan.schedules.sampling is not None:  # data_efficiency's curriculum sampler (data/sampled_loader.py)
        return curriculum_loader(plan, data, collate_fn, (rank, world_size))
    return make_training_dataloader(
        data,
        micro_batch_size=plan.batch.micro_batch_size,
        rank=rank,
        world_size=world_size,
        drop_last=plan.dataloader_drop_last,
        collate_fn=collate_fn,
    )


def curriculum_loader(plan: EnginePlan, data: Any, collate_fn: Any, rank_and_size: tuple[int, int]) -> Any:
    from slipstream.data.sampled_loader import CurriculumDataLoader

    assert plan.schedules.sampling is not None
    return CurriculumDataLoader(
        data,
        plan.schedules.sampling,
        micro_batch_size=plan.batch.micro_batch_size,
        rank_and_size=rank_and_size,
        gradient_accumulation_steps=plan.batch.gradient_accumulation_steps,
        drop_last=plan.dataloader_drop_last,
        collate_fn=collate_fn,
    )


def tell_epoch_length(optimizer: Any, loader: Any, accumulation: int) -> None:
    """ZenFlow's "epoch" selection counts optimizer steps per epoch of the engine's loader (DeepSpeed: its
    length); without a loader (or one of unknown length) it selects once."""
    setter = getattr(optimizer, "set_steps_per_epoch", None)
    if setter is None:
        return
    try:
        batches = len(loader) if loader is not None else 0
    except TypeError:
        batches = 0
    setter(batches // max(accumulation, 1))


def cast_floating(tree: object, dtype: torch.dtype) -> Any:
    """Cast the floating-point tensors of nested tuples/lists/dicts to `dtype` (others unchanged)."""
    if isinstance(tree, torch.Tensor):
        return tree.to(dtype) if tree.is_floating_point() else tree
    if isinstance(tree, (tuple, list)):
        return type(tree)(cast_floating(t, dtype) for t in tree)
    if isinstance(tree, dict):
        return {k: cast_floating(v, dtype) for k, v in tree.items()}
    return tree


def _culprit(optimizer: ZeroOptimizer) -> str:
    """Where the non-finite gradients are, as far as this rank can tell."""
    name = optimizer.last_nonfinite_param
    if name:
        return f"the first parameter with non-finite gradients (in this rank's shard) is '{name}'"
    return "this rank's shard of the gradients is finite; another rank holds the non-finite values"


def stuck_scale_message(scaler: Any, optimizer: ZeroOptimizer) -> str:
    return (
        f"fp16 loss scale has been at its minimum ({scaler.scale:g}) with overflowing gradients for "
        f"{getattr(scaler, 'window', '?')} steps: training is not learning; {_culprit(optimizer)}. Lower the "
        "learning rate, check the data for inf/nan, or train in bf16"
    )


def skipped_steps_message(count: int, optimizer: ZeroOptimizer) -> str:
    return (
        f"{count} optimizer steps in a row were skipped because gradients were not finite: training is not "
        f"learning; {_culprit(optimizer)}. Check the data and the loss for inf/nan, lower the learning rate, "
        'or raise "max_consecutive_skipped_steps" (0 never stops)'
    )


def log_engine_plan(plan: EnginePlan, *, world_size: int, rank: int) -> None:
    """Rank 0: the engine's line (ZeRO stage, dtypes, the batch and where it came from); the resolved config at
    debug level."""
    log_rank0(
        f"engine: ZeRO stage {plan.zero.stage}, world size {world_size}, params "
        f"{plan.precision.param_dtype}, master {plan.precision.master_dtype}, grad accumulation "
        f"{plan.precision.grad_accum_dtype}; batch {plan.batch.train_batch_size} = micro "
        f"{plan.batch.micro_batch_size} x accumulation {plan.batch.gradient_accumulation_steps} x "
        f"data-parallel {plan.batch.world_size} ({'; '.join(f'{k}: {v}' for k, v in plan.batch.sources.items())})",
        rank=rank,
    )
    if rank == 0:
        get_logger().debug("resolved config (defaults included): %s", json.dumps(plan.resolved, default=str))

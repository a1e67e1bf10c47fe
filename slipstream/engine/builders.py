"""How the engine's parts are made from the plan: module placement, optimizers, ZeRO stage, scheduler, data.

Each function takes the piece of the plan it needs; the engine calls them once, in `__init__`.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from slipstream.comm import collectives
from slipstream.config.plan import EnginePlan, LossScalePlan, MonitorPlan, PrecisionPlan
from slipstream.engine.dataloader import make_training_dataloader
from slipstream.engine.monitor import CsvMonitor, TensorboardMonitor
from slipstream.offload.policy import CPUOffload, NoOffload, OffloadPolicy, host_available_bytes
from slipstream.utils.logging import log_rank0, warn_once
from slipstream.zero.optimizer import DTYPES, ZeroOptimizer
from slipstream.zero.stage0 import Stage0Optimizer
from slipstream.zero.stage1 import Stage1Optimizer
from slipstream.zero.stage2 import Stage2Optimizer

_STAGES: dict[int, type[ZeroOptimizer]] = {0: Stage0Optimizer, 1: Stage1Optimizer, 2: Stage2Optimizer}


def prepare_stage3_module(model: nn.Module, plan: EnginePlan, device: torch.device) -> Any:
    """Stage 3: shard the model's parameters into units (rank 0's values), buffers to the device."""
    from slipstream.zero.stage3.model import ZeroModel, stage3_settings
    from slipstream.zero.stage3.sharded_param import ShardedParameter

    if not isinstance(model, nn.Module):
        raise TypeError(f"initialize(model=...) needs a torch.nn.Module, got {type(model).__name__}")
    dtype = DTYPES[plan.precision.param_dtype]
    with torch.no_grad():
        for param in model.parameters():
            if isinstance(param, ShardedParameter):
                if param.dtype != dtype:
                    raise ValueError(f"parameter '{param.ds_record.name}' was sharded by zero.Init as {param.dtype} but "
                                     f"the config trains in {dtype}; pass dtype={dtype} to zero.Init")
                continue
            param.data = param.data.to(device=device, dtype=dtype if param.is_floating_point() else param.dtype)
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                moved = buffer.to(device)
                if dist.get_world_size() > 1:
                    collectives.broadcast(moved, src=0)
                module._buffers[name] = moved
    stage3 = plan.zero.stage3
    assert stage3 is not None  # resolve.py always sets it at stage 3
    from slipstream.planner import materialised_warning, should_warn_materialised

    whole = sum(p.numel() for p in model.parameters() if not isinstance(p, ShardedParameter))
    if should_warn_materialised(whole, dist.get_world_size()):
        warn_once("z3-materialised", materialised_warning(whole, dist.get_world_size()))
    if (stage3.offload_param or {}).get("device") == "nvme":
        if not (stage3.offload_param or {}).get("nvme_path"):
            raise ValueError("zero_optimization.offload_param.device is \"nvme\" but nvme_path is not set; set it to a "
                             "directory on a fast local disk")
        if plan.zero.offload_optimizer is None or plan.zero.offload_optimizer.device == "none":
            raise ValueError("zero_optimization.offload_param.device \"nvme\" needs offload_optimizer too (device cpu "
                             "or nvme): the fp32 master weights cannot live in the NVMe-resident shards")
    return ZeroModel(model, stage3_settings(stage3, plan.aio), device=device)


def prepare_module(model: nn.Module, precision: PrecisionPlan, device: torch.device) -> nn.Module:
    """Move the model to the device and the parameter dtype; make every rank start from rank 0's values."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"initialize(model=...) needs a torch.nn.Module, got {type(model).__name__}")
    model.to(device)
    dtype = DTYPES[precision.param_dtype]
    if dtype != torch.float32:
        model.to(dtype)
    if dist.get_world_size() > 1:
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                collectives.broadcast(tensor.data, src=0)
    return model


def make_basic_optimizer(module: nn.Module, plan: EnginePlan, client: Any,
                         model_parameters: Any) -> torch.optim.Optimizer | None:
    """The client optimizer (instance or callable), or the one the config names, or None (inference)."""
    params = list(model_parameters) if model_parameters is not None else \
        [p for p in module.parameters() if p.requires_grad]
    if client is not None:
        if plan.optimizer is not None:
            raise ValueError("both an optimizer object (initialize(optimizer=...)) and an 'optimizer' config section "
                             "were given; remove one of them")
        optimizer = client(params) if callable(client) and not isinstance(client, torch.optim.Optimizer) else client
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"initialize(optimizer=...) must be a torch.optim.Optimizer or a callable returning one; "
                            f"got {type(optimizer).__name__}")
        return optimizer
    if plan.optimizer is None:
        return None
    from slipstream.engine.optimizers import build_optimizer

    offload = plan.zero.offload_optimizer is not None and plan.zero.offload_optimizer.device in ("cpu", "nvme")
    return build_optimizer(plan.optimizer, params, cpu_offload=offload)


# Optimizers whose update is elementwise: flattening parameters into shards does not change their math.
ELEMENTWISE_OPTIMIZERS = ("Adam", "AdamW", "SGD", "Adagrad", "Adamax", "NAdam", "RAdam", "RMSprop", "ASGD",
                          "Adadelta", "Lion", "DeepSpeedCPUAdam")


def make_zero_optimizer(optimizer: torch.optim.Optimizer, plan: EnginePlan, zero_model: Any = None) -> ZeroOptimizer:
    stage = plan.zero.stage
    _check_optimizer_kind(optimizer, plan)
    precision = plan.precision
    if stage == 3:
        from slipstream.zero.stage3.optimizer import Stage3Optimizer

        return Stage3Optimizer(optimizer, model=zero_model, group=None, bucket_numel=int(plan.zero.reduce_bucket_size),
                               master_dtype=precision.master_dtype, grad_dtype=precision.grad_accum_dtype,
                               check_overflow=precision.check_grad_overflow, offload=make_offload_policy(plan))
    return _STAGES[stage](optimizer, group=None, bucket_numel=int(plan.zero.reduce_bucket_size),
                          master_dtype=precision.master_dtype, grad_dtype=precision.grad_accum_dtype,
                          check_overflow=precision.check_grad_overflow, offload=make_offload_policy(plan))


def make_offload_policy(plan: EnginePlan) -> OffloadPolicy:
    offload = plan.zero.offload_optimizer
    if offload is None or offload.device == "none":
        return NoOffload()
    if offload.device == "nvme":
        from slipstream.offload.nvme import NVMeOffload

        return NVMeOffload(pin_memory=False, nvme_path=str(offload.nvme_path), rank=dist.get_rank(), aio=plan.aio)
    return CPUOffload(pin_memory=offload.pin_memory)


def _check_optimizer_kind(optimizer: torch.optim.Optimizer, plan: EnginePlan) -> None:
    name = type(optimizer).__name__
    offloaded = plan.zero.offload_optimizer is not None and plan.zero.offload_optimizer.device in ("cpu", "nvme")
    if offloaded and name != "DeepSpeedCPUAdam" and plan.resolved.get("zero_force_ds_cpu_optimizer", True):
        raise ValueError(f"offload_optimizer runs the optimizer on the host, but the optimizer is {name}; use "
                         "DeepSpeedCPUAdam (an 'optimizer' section of type Adam/AdamW does that for you) or set "
                         "\"zero_force_ds_cpu_optimizer\": false to run this one on the host anyway")
    if name in ELEMENTWISE_OPTIMIZERS:
        return
    message = (f"optimizer {name} is not known to be elementwise: ZeRO's flat shards (used at every stage) "
               "would change per-tensor math such as Lamb's trust ratio. Use one of "
               f"{', '.join(ELEMENTWISE_OPTIMIZERS)}, or set \"zero_allow_untested_optimizer\": true to use it anyway")
    if not plan.resolved.get("zero_allow_untested_optimizer", False):
        raise ValueError(message)
    warn_once(f"untested-optimizer:{name}", "slipstream: " + message)


def check_host_memory(optimizer: ZeroOptimizer, *, rank: int) -> None:
    """With offload: say how much host memory it needs, and stop with numbers if the host clearly lacks it."""
    per_rank = optimizer.host_bytes_needed()
    if not per_rank:
        return
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")))
    need, available = per_rank * local_ranks, host_available_bytes()
    log_rank0(f"offload: host memory needed {per_rank / 2**30:.3f} GiB per rank, {need / 2**30:.3f} GiB for "
              f"{local_ranks} local rank(s); available {available / 2**30:.3f} GiB", rank=rank)
    if available and need > available:
        raise RuntimeError(f"optimizer offload needs {need / 2**30:.2f} GiB of host memory on this node "
                           f"({local_ranks} ranks x {per_rank / 2**30:.2f} GiB) but only {available / 2**30:.2f} GiB is "
                           "available; use fewer ranks per node, a higher ZeRO stage, or a larger host")


def log_memory_plan(plan: EnginePlan, module: nn.Module, *, world_size: int, rank: int) -> None:
    """Rank 0: one line with the planner's prediction for this run (slipstream/planner)."""
    if rank != 0:
        return
    from slipstream.planner import engine_line

    try:
        line = engine_line(plan=plan, model=module, world_size=world_size,
                           gpus_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except (ValueError, TypeError, NotImplementedError) as exc:  # an estimate must never stop a run
        line = f"memory plan: not available for this model ({exc})"
    log_rank0(line, rank=rank)


def make_scheduler(plan: EnginePlan, optimizer: torch.optim.Optimizer | None, client: Any) -> Any:
    if client is not None:
        if plan.scheduler is not None:
            raise ValueError("both a scheduler object (initialize(lr_scheduler=...)) and a 'scheduler' config "
                             "section were given; remove one of them")
        if callable(client) and not hasattr(client, "step"):
            return client(optimizer)
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
    return make_training_dataloader(data, micro_batch_size=plan.batch.micro_batch_size, rank=rank,
                                    world_size=world_size, drop_last=plan.dataloader_drop_last,
                                    collate_fn=collate_fn)


def make_monitors(plan: MonitorPlan) -> list[Any]:
    monitors: list[Any] = []
    if plan.csv_output_path is not None:
        monitors.append(CsvMonitor(plan.csv_output_path, plan.csv_job_name))
    if plan.tensorboard_output_path is not None:
        monitors.append(TensorboardMonitor(plan.tensorboard_output_path, plan.tensorboard_job_name))
    return monitors


def cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    """Cast the floating-point tensors of nested tuples/lists/dicts to `dtype` (others unchanged)."""
    if isinstance(tree, torch.Tensor):
        return tree.to(dtype) if tree.is_floating_point() else tree
    if isinstance(tree, (tuple, list)):
        return type(tree)(cast_floating(t, dtype) for t in tree)
    if isinstance(tree, dict):
        return {k: cast_floating(v, dtype) for k, v in tree.items()}
    return tree


def stuck_scale_message(scaler: Any, optimizer: ZeroOptimizer) -> str:
    culprit = optimizer.last_nonfinite_param
    where = (f"; the first parameter with non-finite gradients (in this rank's shard) is '{culprit}'" if culprit
             else "; this rank's shard of the gradients is finite, another rank holds the overflow")
    return (f"fp16 loss scale has been at its minimum ({scaler.scale:g}) with overflowing gradients for "
            f"{getattr(scaler, 'window', '?')} steps: training is not learning{where}. Lower the learning rate, check the data "
            "for inf/nan, or train in bf16")


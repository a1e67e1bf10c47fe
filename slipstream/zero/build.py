"""`build_zero`: the one place a ZeRO stage is chosen. It owns the stage table (stage 3 included), places the
model for its stage, and wraps the optimizer.

Two phases, because the optimizer is built over the placed model's parameters:
    zero = build_zero(model, plan=plan.zero, precision=plan.precision, device=device)   # module placed
    optimizer = zero.wrap(basic_optimizer, rank=rank)                                   # ZeroOptimizer
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from slipstream.comm import collectives
from slipstream.config.optimizers import REGISTRY, spec_for_class
from slipstream.config.plan import PrecisionPlan, ZeroPlan
from slipstream.offload.choose import policy_for
from slipstream.utils.logging import warn_once
from slipstream.zero.optimizer import DTYPES, GroupFor, ZeroOptimizer
from slipstream.zero.sparse_rows import SparseRows, embedding_tables
from slipstream.zero.stage0 import Stage0Optimizer
from slipstream.zero.stage1 import Stage1Optimizer
from slipstream.zero.stage2 import Stage2Optimizer
from slipstream.zero.stage3.model import UnitGroups, ZeroModel
from slipstream.zero.stage3.optimizer import Stage3Optimizer
from slipstream.zero.stage3.sharded_param import ShardedParameter

__all__ = ["STAGES", "ZeroBuild", "build_zero"]

Sources = dict[int, tuple[int, Any]]
Extend = Callable[[type[ZeroOptimizer]], type[ZeroOptimizer]]

STAGES: dict[int, type[ZeroOptimizer]] = {
    0: Stage0Optimizer,
    1: Stage1Optimizer,
    2: Stage2Optimizer,
    3: Stage3Optimizer,
}


@dataclasses.dataclass
class ZeroBuild:
    """The model placed for its stage, and how to wrap its optimizer."""

    module: nn.Module
    zero_model: ZeroModel | None
    """Stage 3: the sharded units (None below stage 3)."""
    zero: ZeroPlan
    precision: PrecisionPlan
    group: dist.ProcessGroup | None = None
    """The data-parallel group ZeRO shards and reduces over (None: the whole world)."""
    extend: Extend | None = None
    """Makes a subclass of the chosen stage class (the pipeline's tied weights and norm, pipe/grads.py)."""

    def wrap(self, optimizer: torch.optim.Optimizer, *, rank: int, group_for: GroupFor | None = None) -> ZeroOptimizer:
        """The stage's ZeRO optimizer around `optimizer` (whose param groups it re-points at master pieces);
        `group_for` gives param groups reduced over another process group (ZeroOptimizer)."""
        check_optimizer_kind(optimizer, self.zero)
        extra: dict[str, Any] = {} if group_for is None else {"group_for": group_for}
        stage = STAGES[self.zero.stage]
        if self.zero.zenflow is not None:  # stages 1-2 with CPU offload (config/resolve.py checks)
            from slipstream.zero.zenflow import zenflow_stage

            stage = zenflow_stage(stage)
        if self.extend is not None:
            stage = self.extend(stage)
        built = stage(
            optimizer,
            zero=self.zero,
            precision=self.precision,
            model=self.zero_model,
            offload=policy_for(self.zero.offload_optimizer, rank=rank),
            group=self.group,
            **extra,
        )
        if self.zero.sparse_gradients and isinstance(built, Stage0Optimizer):
            built.sparse_rows = SparseRows(built.groups, embedding_tables(self.module))
        return built


def build_zero(
    model: nn.Module,
    *,
    zero: ZeroPlan,
    precision: PrecisionPlan,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
    sources: Sources | None = None,
    unit_groups: UnitGroups | None = None,
    extend: Extend | None = None,
) -> ZeroBuild:
    """Place `model` for `zero.stage`: on the device in the parameter dtype with the values of the group's first
    rank (stages 0-2), or sharded into units over `group` (stage 3). `group` None is the whole world; with
    tensor parallelism it is the data-parallel group of this rank's shard. `sources` maps id(param) -> (global
    source rank, process group) for parameters whose values come from elsewhere (MoE experts); `unit_groups`
    does the same for the stage-3 units of marked modules (stage3/units.py [Note: units over other groups]).
    `extend` subclasses the stage class the optimizer is wrapped in (the pipeline's, pipe/grads.py)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"initialize(model=...) needs a torch.nn.Module, got {type(model).__name__}")
    if zero.stage == 3:
        if zero.stage3 is None:
            raise RuntimeError("ZeRO stage 3 without a Stage3Plan: build plans with slipstream.config.resolve")
        _place_for_stage3(model, precision, device, group)
        return ZeroBuild(
            module=model,
            zero_model=ZeroModel(model, zero.stage3, device=device, group=group, unit_groups=unit_groups),
            zero=zero,
            precision=precision,
            group=group,
        )
    _place_replicated(model, precision, device, group, sources or {})
    return ZeroBuild(module=model, zero_model=None, zero=zero, precision=precision, group=group, extend=extend)


def _place_replicated(
    model: nn.Module, precision: PrecisionPlan, device: torch.device, group: dist.ProcessGroup | None, sources: Sources
) -> None:
    if any(isinstance(p, ShardedParameter) for p in model.parameters()):
        from slipstream.zero.gathered import unshard_parameters

        count = unshard_parameters(list(model.parameters()))
        warn_once(
            "zero-init-unsharded",
            f"the model was built under zero.Init but the ZeRO stage is 0-2: its {count} sharded parameters were "
            "gathered whole on every rank; set zero_optimization.stage to 3 to keep them sharded",
        )
    model.to(device)
    dtype = DTYPES[precision.param_dtype]
    if dtype != torch.float32:
        model.to(dtype)
    if dist.get_world_size(group) > 1:
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                src, source_group = sources.get(id(tensor), (collectives.first_rank(group), group))
                if source_group is None or dist.get_world_size(source_group) > 1:
                    collectives.broadcast(tensor.data, src=src, group=source_group)


def _place_for_stage3(
    model: nn.Module, precision: PrecisionPlan, device: torch.device, group: dist.ProcessGroup | None
) -> None:
    """Plain parameters to the device and dtype (ZeroModel shards them); buffers from rank 0."""
    dtype = DTYPES[precision.param_dtype]
    with torch.no_grad():
        for param in model.parameters():
            if isinstance(param, ShardedParameter):
                if param.dtype != dtype:
                    raise ValueError(
                        f"parameter '{param.ds_record.name}' was sharded by zero.Init as {param.dtype} "
                        f"but the config trains in {dtype}; pass dtype={dtype} to zero.Init"
                    )
                continue
            param.data = param.data.to(device=device, dtype=dtype if param.is_floating_point() else param.dtype)
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                moved = buffer.to(device)
                if dist.get_world_size(group) > 1:
                    collectives.broadcast(moved, src=collectives.first_rank(group), group=group)
                module._buffers[name] = moved


def elementwise_class_names() -> tuple[str, ...]:
    return tuple(name for spec in REGISTRY.values() if spec.elementwise for name in spec.class_names)


def check_optimizer_kind(optimizer: torch.optim.Optimizer, zero: ZeroPlan) -> None:
    """Refuse optimizers whose math flat shards would change, and host-less optimizers under offload."""
    name = type(optimizer).__name__
    stages = getattr(type(optimizer), "zero_stages", (0,))
    if zero.stage not in stages and callable(getattr(optimizer, "takes_over_reduction", None)):
        why = "stages 2-3 shard the gradients themselves" if zero.stage > 1 else getattr(optimizer, "zero_refusal", "")
        raise ValueError(
            f"optimizer {name} communicates its own gradients (1-bit compression), which ZeRO stage {zero.stage} "
            f"cannot hand it ({why}; DeepSpeed refuses it with any ZeRO stage); set zero_optimization.stage to "
            f"{' or '.join(map(str, stages))}, or use Adam/AdamW with ZeRO"
        )
    host_kernel = getattr(type(optimizer), "writes_low_precision_copy", False)
    host_kernel = host_kernel or getattr(type(optimizer), "runs_on_host", False)  # ours: slipstream/optim
    if zero.offload_optimizer.on_host and not host_kernel and zero.force_host_optimizer:
        raise ValueError(
            f"offload_optimizer runs the optimizer on the host, but the optimizer is {name}; use "
            "DeepSpeedCPUAdam (an 'optimizer' section of type Adam/AdamW does that for you) or set "
            '"zero_force_ds_cpu_optimizer": false to run this one on the host anyway'
        )
    spec: Any = spec_for_class(name)
    if (spec is not None and spec.elementwise) or getattr(type(optimizer), "wants_whole_tensors", False):
        return
    message = (
        f"optimizer {name} is not known to be elementwise: ZeRO's flat shards (used at every stage) "
        "would change per-tensor math such as Adafactor's factored moments. Use one of "
        f'{", ".join(elementwise_class_names())}, or set "zero_allow_untested_optimizer": true to use it '
        "anyway"
    )
    if not zero.allow_untested_optimizer:
        raise ValueError(message)
    warn_once(f"untested-optimizer:{name}", "slipstream: " + message)

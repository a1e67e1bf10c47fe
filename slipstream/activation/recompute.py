"""DeepSpeed's `deepspeed.checkpointing` on `torch.utils.checkpoint` (non-reentrant).

`checkpoint(function, *args)` runs `function` without keeping its intermediate activations and recomputes
them in the backward pass. The RNG state (CPU and accelerator) is restored for the recomputation, so dropout
masks equal those of the first forward, and a run equals one without checkpointing.

Options (`configure()` or the `activation_checkpointing` config section):
- `partition_activations`: each rank of the model-parallel group keeps 1/N of every checkpointed input
  (inputs are replicated within the group in a tensor-parallel region); the recomputation all-gathers it.
- `cpu_checkpointing` / `checkpoint_in_cpu`: activation offload: checkpointed inputs are copied to pinned
  host buffers on the copy stream, released from the graph, and prefetched back ahead of their
  recomputation (activation/offload.py).
- `contiguous_memory_optimization` / `contiguous_checkpointing` with `number_checkpoints` / `num_checkpoints`
  (or `set_num_layers`): a step's checkpointed inputs are packed into one preallocated buffer per dtype.
- `synchronize_checkpoint_boundary`: synchronise the device around each checkpointed forward and recomputation.
- `profile`: log the time of each checkpointed forward and recomputation.

`selective_checkpoint(function, *args)` keeps the outputs of matmul-class ops and recomputes only the cheap
ones (torchtitan's selective activation checkpointing), trading some memory for less recomputation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import checkpoint as torch_checkpoint

from slipstream.accelerator import get_accelerator
from slipstream.activation.mpu import model_parallel_group, model_parallel_rank, set_mpu
from slipstream.activation.offload import CheckpointStore
from slipstream.activation.rng import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
from slipstream.config.plan import ActivationCheckpointPlan
from slipstream.config.section_plans import activation_checkpoint_plan
from slipstream.utils.logging import get_logger
from slipstream.utils.torch_versions import require_torch

__all__ = [
    "checkpoint",
    "configure",
    "get_cuda_rng_tracker",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "model_parallel_rank",
    "non_reentrant_checkpoint",
    "partition_activations_in_checkpoint",
    "reset",
    "selective_checkpoint",
    "set_num_layers",
    "store",
]


class _TracedFlags:
    """The settings a checkpointed call reads, copied into a plain object: torch.compile guards what a traced
    function reads, and torch 2.4's dynamo fails to guard a slotted dataclass such as the plan ("cannot create
    weak reference to 'ActivationCheckpointPlan' object")."""

    def __init__(self, plan: ActivationCheckpointPlan) -> None:
        self.partition_activations = plan.partition_activations
        self.synchronize = plan.synchronize
        self.profile = plan.profile


_settings = activation_checkpoint_plan({})  # the schema's defaults
_flags = _TracedFlags(_settings)
_configured = False
_store = CheckpointStore(to_host=False, contiguous=False, number_checkpoints=None)


# ---- configuration ----
def configure(
    mpu_: object,
    deepspeed_config: object = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """Set the options (DeepSpeed's signature): the config's `activation_checkpointing` section first, then
    the arguments that are not None. `mpu_` gives the model-parallel group (`get_tensor_model_parallel_group()`
    or `get_model_parallel_group()`)."""
    settings = activation_checkpoint_plan({})
    if deepspeed_config is not None:
        settings = _section_of(deepspeed_config)
    overrides: dict[str, Any] = {
        "partition_activations": partition_activations,
        "cpu_checkpointing": checkpoint_in_cpu,
        "contiguous_memory_optimization": contiguous_checkpointing,
        "number_checkpoints": num_checkpoints,
        "synchronize": synchronize,
        "profile": profile,
    }
    settings = dataclasses.replace(settings, **{k: v for k, v in overrides.items() if v is not None})
    if mpu_ is not None:
        set_mpu(mpu_)
    configure_from_plan(settings)


def configure_from_plan(plan: ActivationCheckpointPlan) -> None:
    """The engine's call when the config has an `activation_checkpointing` section (DeepSpeed leaves that
    to the client's `configure(mpu, deepspeed_config=...)`; here the section works either way)."""
    global _settings, _configured, _store, _flags
    _store = CheckpointStore(
        to_host=plan.cpu_checkpointing,
        contiguous=plan.contiguous_memory_optimization,
        number_checkpoints=plan.number_checkpoints,
    )
    _settings, _configured, _flags = plan, True, _TracedFlags(plan)


def store() -> CheckpointStore:
    """Where checkpointed inputs wait under the current settings (its `stats` count offloads and prefetches)."""
    return _store


def _section_of(deepspeed_config: object) -> ActivationCheckpointPlan:
    from slipstream.config.load import load_config

    raw = deepspeed_config if isinstance(deepspeed_config, dict) else getattr(deepspeed_config, "config", None)
    raw = load_config(deepspeed_config) if raw is None else raw
    return activation_checkpoint_plan(raw.get("activation_checkpointing", {}))


def is_configured() -> bool:
    return _configured


def reset() -> None:
    """Free the host and contiguous buffers (they are allocated again by the next checkpointed step)."""
    _store.release()


def partition_activations_in_checkpoint(partition_activation: bool) -> None:
    global _settings, _flags
    _settings = dataclasses.replace(_settings, partition_activations=partition_activation)
    _flags = _TracedFlags(_settings)


def set_num_layers(nlayers: int) -> None:
    """Size the contiguous buffer for `nlayers` checkpointed calls per forward (`number_checkpoints`)."""
    configure_from_plan(dataclasses.replace(_settings, number_checkpoints=nlayers))


# ---- checkpointed calls ----
def checkpoint(function: Callable[..., object], *args: object, **kwargs: object) -> Any:
    """Run `function(*args, **kwargs)` keeping only its inputs; its activations are recomputed in backward."""
    group = model_parallel_group() if _flags.partition_activations else None
    group_size = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
    stash = _Stash(group if group_size > 1 else None)
    stored = stash.keep(args)
    forward_done = False

    def recompute(*kept: object) -> Any:
        with _boundary("recomputation" if forward_done else "forward", function):
            return function(*stash.restore(kept), **kwargs)

    hooks = _store.hooks() if _store.active else contextlib.nullcontext()
    with hooks:
        output = torch_checkpoint.checkpoint(recompute, *stored, use_reentrant=False, preserve_rng_state=True)
    forward_done = True
    return output


@contextlib.contextmanager
def _boundary(what: str, function: Callable[..., object]) -> Iterator[None]:
    """`synchronize` and `profile` around a checkpointed forward or its recomputation; nothing at all when both
    are off (then a compiled block traces the checkpoint without a graph break: no clock read)."""
    if not (_flags.synchronize or _flags.profile):
        yield
        return
    if _flags.synchronize:
        get_accelerator().synchronize()
    started = time.perf_counter()
    try:
        yield
    finally:  # also when torch stops a recomputation early, once it has what the backward needs
        _after_boundary(what, function, started)


def _after_boundary(what: str, function: Callable[..., object], started: float) -> None:
    if _flags.synchronize:
        get_accelerator().synchronize()
    if _flags.profile:
        get_logger().info(
            "checkpointed %s of %s: %.3f ms", what, _name(function), (time.perf_counter() - started) * 1e3
        )


non_reentrant_checkpoint = checkpoint


def selective_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Like `checkpoint`, but the outputs of matmul-class ops are saved and only the rest is recomputed."""
    require_torch("2.5", "slipstream.checkpointing.selective_checkpoint (torch's selective checkpoint contexts)")
    saved_ops = {
        torch.ops.aten.mm.default,
        torch.ops.aten.addmm.default,
        torch.ops.aten.bmm.default,
        torch.ops.aten.baddbmm.default,
        torch.ops.aten.convolution.default,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    }
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention"):
        op = getattr(torch.ops.aten, name, None)
        if op is not None:
            saved_ops.add(op.default)

    def policy(ctx: Any, op: Any, *a: Any, **k: Any) -> Any:
        save = op in saved_ops
        return (
            torch_checkpoint.CheckpointPolicy.MUST_SAVE if save else torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE
        )

    return torch_checkpoint.checkpoint(
        function,
        *args,
        use_reentrant=False,
        preserve_rng_state=True,
        context_fn=lambda: torch_checkpoint.create_selective_checkpoint_contexts(policy),
        **kwargs,
    )


def _name(function: Callable[..., object]) -> str:
    return getattr(function, "__qualname__", None) or type(function).__name__


# ---- where checkpointed inputs wait ----
class _Stash:
    """Keeps a 1/N slice of each checkpointed tensor input per model-parallel rank (`group`); `restore`
    brings it back whole, in the graph. (Host offload is the store's: activation/offload.py.)"""

    def __init__(self, group: object) -> None:
        self.group = group
        self.shapes: list[tuple[torch.Size, torch.device] | None] = []

    def keep(self, args: tuple[object, ...]) -> tuple[Any, ...]:
        kept = []
        for arg in args:
            if not isinstance(arg, torch.Tensor) or not arg.is_floating_point():
                self.shapes.append(None)
                kept.append(arg)
                continue
            self.shapes.append((arg.shape, arg.device))
            if self.group is not None:
                arg = _Partition.apply(arg, self.group)  # type: ignore[no-untyped-call]
            kept.append(arg)
        return tuple(kept)

    def restore(self, kept: tuple[Any, ...]) -> tuple[Any, ...]:
        restored = []
        for arg, shape in zip(kept, self.shapes, strict=True):
            if shape is not None:
                full_shape, _ = shape
                if self.group is not None:
                    arg = _Gather.apply(arg, self.group, full_shape)  # type: ignore[no-untyped-call]
            restored.append(arg)
        return tuple(restored)


def _chunk(numel: int, group: dist.ProcessGroup | None) -> tuple[int, int]:
    size = dist.get_world_size(group)
    per_rank = -(-numel // size)
    return per_rank, per_rank * size


class _Partition(torch.autograd.Function):
    """Keep this rank's 1/N of a tensor replicated in the group; the gradient comes back whole."""

    @staticmethod
    def forward(ctx: Any, full: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        per_rank, padded = _chunk(full.numel(), group)
        ctx.group, ctx.shape, ctx.numel = group, full.shape, full.numel()
        flat = torch.nn.functional.pad(full.detach().reshape(-1), (0, padded - full.numel()))
        rank = dist.get_rank(group)
        return flat[rank * per_rank : (rank + 1) * per_rank].clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        whole = _all_gather(grad.contiguous(), ctx.group)
        return whole[: ctx.numel].view(ctx.shape), None


class _Gather(torch.autograd.Function):
    """Rebuild the whole tensor from the ranks' slices; the (replicated) gradient goes back as this rank's slice."""

    @staticmethod
    def forward(ctx: Any, part: torch.Tensor, group: dist.ProcessGroup | None, shape: torch.Size) -> torch.Tensor:
        ctx.group, ctx.per_rank = group, part.numel()
        numel = int(torch.Size(shape).numel())
        return _all_gather(part.contiguous(), group)[:numel].view(shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        per_rank, rank = ctx.per_rank, dist.get_rank(ctx.group)
        flat = grad.reshape(-1)
        flat = torch.nn.functional.pad(flat, (0, per_rank * dist.get_world_size(ctx.group) - flat.numel()))
        return flat[rank * per_rank : (rank + 1) * per_rank].clone(), None, None


def _all_gather(part: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    from slipstream.comm import collectives

    out = torch.empty(part.numel() * dist.get_world_size(group), dtype=part.dtype, device=part.device)
    collectives.all_gather(out, part, group=group)
    return out

"""DeepSpeed's small runtime helpers that client code calls: `see_memory_usage`, `set_random_seed`,
`clip_grad_norm_`, `get_global_norm`, `log_dist`, `required_torch_version`, `clone_tensors_for_torch_save`,
`prefix_sum_inc`, the ZeRO helpers of `deepspeed.runtime.zero.utils`, and the `logger`. Their DeepSpeed paths are declared in
compat/aliases.py (COMPOSITES)."""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Callable, Iterable
from typing import Any

import torch

from slipstream.utils.logging import get_logger

MIN_SWAPPABLE_BYTES = 1024**2
"""`deepspeed.runtime.swap_tensor.MIN_SWAPPABLE_BYTES` (1 MiB), which client code uses to size tensors that NVMe
offload will swap. Slipstream has no such threshold (it swaps whole sub-groups, docs/offload.md); the
constant has DeepSpeed's value."""

__all__ = [
    "MIN_SWAPPABLE_BYTES",
    "DeepSpeedOptimizerCallable",
    "OnDevice",
    "PartitionedTensor",
    "DeepSpeedSchedulerCallable",
    "ZeRORuntimeException",
    "apply_to_tensors_only",
    "clip_grad_norm_",
    "clone_tensors_for_torch_save",
    "get_global_norm",
    "is_zero_supported_optimizer",
    "log_dist",
    "move_to_device",
    "logger",
    "prefix_sum_inc",
    "required_torch_version",
    "see_memory_usage",
    "set_random_seed",
]

logger: logging.Logger = get_logger()
DeepSpeedOptimizerCallable = Callable[[Any], torch.optim.Optimizer]
DeepSpeedSchedulerCallable = Callable[[torch.optim.Optimizer], Any]


class ZeRORuntimeException(Exception):
    pass


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def see_memory_usage(message: str, force: bool = False) -> None:
    """Log the accelerator's allocated / peak memory and the host's used memory (rank 0, when `force`)."""
    if not force or _rank() != 0:
        return
    from slipstream.accelerator import get_accelerator

    acc = get_accelerator()
    gib = 1024**3
    try:
        import psutil  # type: ignore[import-untyped]

        used = psutil.virtual_memory().used / gib
        host = f" | CPU used {used:.2f} GB"
    except ImportError:
        host = ""
    logger.info(
        "%s | MA %.2f GB | Max_MA %.2f GB%s",
        message,
        acc.memory_allocated() / gib,
        acc.max_memory_allocated() / gib,
        host,
    )
    acc.reset_peak_memory_stats()


def set_random_seed(seed: int) -> None:
    """Seed Python, NumPy (when installed), torch and the accelerator."""
    random.seed(seed)
    try:
        import numpy

        numpy.random.seed(seed)
    except ImportError:
        pass
    torch.manual_seed(seed)
    from slipstream.accelerator import get_accelerator

    get_accelerator().manual_seed_all(seed)


def get_global_norm(norm_list: Iterable[float]) -> float:
    """The 2-norm of norms."""
    return float(sum(float(n) ** 2 for n in norm_list) ** 0.5)


def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2, mpu: Any = None) -> float:
    """Clip the gradients of local (unsharded) parameters; returns the total norm before clipping."""
    del mpu
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p for p in params if p.grad is not None]
    return float(torch.nn.utils.clip_grad_norm_(grads, max_norm, norm_type=norm_type))


def is_zero_supported_optimizer(optimizer: Any) -> bool:
    """True for an optimizer ZeRO steps without `zero_allow_untested_optimizer`: an elementwise update, or one
    that steps ZeRO's pieces through the whole-tensor map (LAMB, Muon)."""
    from slipstream.config.optimizers import REGISTRY

    name = type(optimizer).__name__
    if getattr(type(optimizer), "wants_whole_tensors", False):
        return True
    return any(name in spec.class_names and spec.elementwise for spec in REGISTRY.values())


def apply_to_tensors_only(function: Callable[[torch.Tensor], Any], value: Any, warning_msg_fn: Any = None) -> Any:
    """Apply `function` to every tensor in nested tuples, lists and dicts; other values pass through."""
    del warning_msg_fn
    if isinstance(value, (tuple, list)):
        return type(value)(apply_to_tensors_only(function, v) for v in value)
    if isinstance(value, dict):
        return {k: apply_to_tensors_only(function, v) for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        return function(value)
    return value


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = "cpu") -> Any:
    """A copy of `item` whose tensors are detached clones on `device`, so `torch.save` writes only their own
    storage (not the whole flat buffer a view shares). Containers keep their type."""
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item


def prefix_sum_inc(weights: Iterable[float]) -> list[float]:
    """Inclusive running sums: [3, 4, 5] -> [3, 7, 12]."""
    return list(itertools.accumulate(weights))


class PartitionedTensor:
    """DeepSpeed's `runtime.utils.PartitionedTensor` (a tensor split across a group, for its pipeline engine's
    activations, split over tensor-parallel ranks). Slipstream's pipeline does not split the tensors it
    sends between stages, so there is none."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "deepspeed.runtime.utils.PartitionedTensor is not implemented in Slipstream: its pipeline engine "
            "sends stage outputs whole; split a tensor with torch.chunk and rebuild it with all_gather instead"
        )


def move_to_device(item: Any, device: Any, criterion_func: Callable[[Any], bool] | None = None) -> Any:
    """Move the tensors in `item` (nested lists, tuples, dicts) that `criterion_func` accepts (all, when None)
    to `device`, in place (their `.data` changes, so references stay valid); returns the same structure."""
    if isinstance(item, list):
        return [move_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        return tuple(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    if isinstance(item, torch.Tensor) and (criterion_func is None or criterion_func(item)):
        item.data = item.data.to(device)
    return item


class OnDevice:
    """Build a model's tensors on `device` ("meta" by default: shapes only) and floating-point tensors in
    `dtype`, inside the context (DeepSpeed's `OnDevice`); `enabled=False` makes it do nothing."""

    def __init__(self, dtype: torch.dtype | None, device: Any = "meta", enabled: bool = True) -> None:
        self.dtype, self.device, self.enabled = dtype, torch.device(device), enabled
        self._saved: list[Any] = []

    def __enter__(self) -> OnDevice:
        if self.enabled:
            self._saved = [torch.get_default_dtype(), self.device]
            self.device.__enter__()
            if self.dtype is not None and self.dtype.is_floating_point:
                torch.set_default_dtype(self.dtype)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.enabled and self._saved:
            dtype, device = self._saved
            torch.set_default_dtype(dtype)
            device.__exit__(*exc)


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Log `message` on the listed global ranks (all ranks for -1; rank 0 when None)."""
    wanted = [0] if ranks is None else list(ranks)
    rank = _rank()
    if -1 in wanted or rank in wanted:
        logger.log(level, "[Rank %d] %s", rank, message)


def _major_minor(version: float | str) -> tuple[int, ...]:
    return tuple(
        int("".join(c for c in part if c.isdigit()) or 0) for part in str(version).split("+")[0].split(".")[:2]
    )


def required_torch_version(min_version: float | str | None = None, max_version: float | str | None = None) -> bool:
    """True when the installed torch is within [min_version, max_version] (major.minor, as DeepSpeed compares)."""
    current = _major_minor(torch.__version__)
    if min_version is not None and current < _major_minor(min_version):
        return False
    return not (max_version is not None and current > _major_minor(max_version))

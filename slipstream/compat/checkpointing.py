"""`deepspeed.checkpointing` (`deepspeed.runtime.activation_checkpointing.checkpointing`): activation
checkpointing for client code that calls DeepSpeed's functions, on `torch.utils.checkpoint`.

`checkpoint(function, *args)` recomputes `function` in backward (torch's non-reentrant checkpoint, which
handles the RNG state and works with ZeRO-3's gathered parameters). DeepSpeed's extra options of `configure`
(partitioning activations across model-parallel ranks, contiguous buffers, CPU checkpointing, profiling)
are not implemented: `configure` raises NotImplementedError naming any of them that is set.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils.checkpoint

__all__ = [
    "checkpoint",
    "configure",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "non_reentrant_checkpoint",
    "reset",
]

_CONFIGURED: list[bool] = []


def checkpoint(function: Any, *args: Any) -> Any:
    """`function(*args)`, its activations recomputed in backward instead of kept."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


non_reentrant_checkpoint = checkpoint


def configure(
    mpu_: Any = None,
    deepspeed_config: Any = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """Accept DeepSpeed's call; an option Slipstream does not implement, set true, is an error naming it."""
    del mpu_, deepspeed_config, num_checkpoints
    options = {
        "partition_activations": partition_activations,
        "contiguous_checkpointing": contiguous_checkpointing,
        "checkpoint_in_cpu": checkpoint_in_cpu,
        "synchronize": synchronize,
        "profile": profile,
    }
    chosen = sorted(name for name, value in options.items() if value)
    if chosen:
        raise NotImplementedError(
            f"deepspeed.checkpointing.configure: {', '.join(chosen)} not implemented in Slipstream; "
            "checkpoint() recomputes activations with torch.utils.checkpoint"
        )
    _CONFIGURED[:] = [True]


def is_configured() -> bool:
    return bool(_CONFIGURED)


def reset() -> None:
    """DeepSpeed frees its contiguous checkpoint buffers here; there are none."""
    return None


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed torch and the accelerator (there is one model-parallel rank)."""
    from slipstream.accelerator import get_accelerator

    torch.manual_seed(seed)
    get_accelerator().manual_seed_all(seed)

"""The model-parallel unit (mpu) that `checkpointing.configure` was given, and its tensor-parallel group and
rank: what partitioned activations split over (recompute.py) and what the model-parallel seed offsets by
(rng.py). An `mpu` passed to a call wins over the configured one."""

from __future__ import annotations

from typing import Any

_mpu: Any = None


def set_mpu(mpu: object) -> None:
    global _mpu
    _mpu = mpu


def model_parallel_group(mpu: Any = None) -> Any:
    mpu = mpu if mpu is not None else _mpu
    if mpu is None:
        return None
    getter = getattr(mpu, "get_tensor_model_parallel_group", None) or mpu.get_model_parallel_group
    return getter()


def model_parallel_rank(mpu: Any = None) -> int:
    mpu = mpu if mpu is not None else _mpu
    if mpu is None:
        return 0
    getter = getattr(mpu, "get_tensor_model_parallel_rank", None) or mpu.get_model_parallel_rank
    return int(getter())

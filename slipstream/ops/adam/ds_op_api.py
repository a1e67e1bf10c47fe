"""DeepSpeed's functional `cpu_adam` op interface on Slipstream's op, and its cross-process ZenFlow Adam worker.

`CPUAdamBuilder().load()` returns Slipstream's op module (native or fallback), whose `adam_update` takes lists
of tensors. DeepSpeed's module is driven by id instead, and client code (DeepSpeed's own tests, ZenFlow's
optimizer process) calls it that way; `install(module)` adds those functions to the loaded module:

- `create_adam(id, lr, beta1, beta2, eps, weight_decay, adamw_mode, should_log)`, `destroy_adam(id)`;
- `adam_update(id, step, lr, beta1, beta2, eps, weight_decay, bias_correction, param, grad, exp_avg,
  exp_avg_sq)` next to Slipstream's list form (the first argument tells them apart), one tensor each;
- the ZenFlow optimizer process (DeepSpeed's overlap_step for stages 1-2): a control block in shared memory
  (`zenflow_adam_ctrl_size`, `zenflow_adam_ctrl_init(ptr, groups)`, `zenflow_adam_submit(ptr, now, step,
  lrs, beta1s, beta2s, epss, weight_decays, bias_corrections)`, `zenflow_adam_wait(ptr, timeout_s)` -> bool,
  `zenflow_adam_ctrl_exit(ptr)`), and the worker side (`zenflow_adam_create(id, affinity)` -> handle,
  `zenflow_adam_register_group(handle, param, grad0, grad1, exp_avg0, exp_avg1, exp_avg_sq0, exp_avg_sq1,
  stale)`, `zenflow_adam_run_worker(handle, ptr)`, `zenflow_adam_destroy(handle)`). A submitted step updates
  every registered group from the gradient, moments of double-buffer slot `now` and copies the new values
  into `stale`; `wait` returns True once per completed step and False after `timeout_s` without one.

The control block is a few 8-byte fields at fixed offsets, written and polled through ctypes (DeepSpeed's
native worker uses semaphores; a 0.2 ms poll costs nothing next to an optimizer step). Slipstream's own
ZenFlow (`zero/zenflow.py`) runs its background update in a thread and does not use this.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch

__all__ = ["install"]

_HEADER = 64
_FIELDS = 6  # lr, beta1, beta2, eps, weight_decay, bias_correction per group, float64 each
_MAX_GROUPS = 128
_CTRL_BYTES = _HEADER + _MAX_GROUPS * _FIELDS * 8
# header fields (int64): submitted steps, completed steps, completions taken by wait(), exit, now, step, groups
_SUBMITTED, _DONE, _TAKEN, _EXIT, _NOW, _STEP, _GROUPS = (8 * i for i in range(7))
_POLL_S = 0.0002


def _int(ptr: int, offset: int) -> Any:
    return ctypes.c_int64.from_address(ptr + offset)


def _float(ptr: int, group: int, field: int) -> Any:
    return ctypes.c_double.from_address(ptr + _HEADER + (group * _FIELDS + field) * 8)


def install(module: ModuleType) -> ModuleType:
    """Add DeepSpeed's functional interface to a loaded cpu_adam op module (once)."""
    if getattr(module, "_deepspeed_api", False):
        return module
    id_functions = _id_functions(module.adam_update)
    adam_update = id_functions[-1]
    control_functions = (
        zenflow_adam_ctrl_size,
        zenflow_adam_ctrl_init,
        zenflow_adam_submit,
        zenflow_adam_wait,
        zenflow_adam_ctrl_exit,
    )
    for function in (*id_functions, *control_functions, *_worker_functions(adam_update)):
        setattr(module, function.__name__, function)
    module._deepspeed_api = True  # type: ignore[attr-defined]
    return module


def _id_functions(list_update: Callable[..., Any]) -> tuple[Callable[..., Any], ...]:
    """`create_adam`, `destroy_adam` and the id-or-list `adam_update` (last), sharing one id table."""
    optimizers: dict[int, bool] = {}  # id -> adamw_mode

    def create_adam(
        optimizer_id: int,
        lr: float = 1e-3,
        beta1: float = 0.9,
        beta2: float = 0.999,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw_mode: bool = True,
        should_log: bool = False,
    ) -> int:
        optimizers[int(optimizer_id)] = bool(adamw_mode)
        return 0

    def destroy_adam(optimizer_id: int) -> int:
        optimizers.pop(int(optimizer_id), None)
        return 0

    def adam_update(*args: Any, **kwargs: Any) -> Any:
        if not args or not isinstance(args[0], int):
            return list_update(*args, **kwargs)  # Slipstream's list form
        optimizer_id, step, lr, beta1, beta2, eps, weight_decay, bias_correction, param, grad, m, v = args[:12]
        if optimizer_id not in optimizers:
            raise RuntimeError(
                f"cpu_adam.adam_update: no optimizer {optimizer_id}; call create_adam({optimizer_id}, ...) first"
            )
        list_update(
            [param],
            [grad],
            [m],
            [v],
            step=int(step),
            lr=float(lr),
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(eps),
            weight_decay=float(weight_decay),
            bias_correction=bool(bias_correction),
            adamw_mode=optimizers[optimizer_id],
            low_precision_out=[],
        )
        return 0

    return create_adam, destroy_adam, adam_update


# The ZenFlow control block: the trainer's side (size, init, submit, wait, exit).


def zenflow_adam_ctrl_size() -> int:
    return _CTRL_BYTES


def zenflow_adam_ctrl_init(ptr: int, groups: int) -> None:
    if not 0 < groups <= _MAX_GROUPS:
        raise ValueError(f"zenflow_adam_ctrl_init: {groups} groups; 1 to {_MAX_GROUPS} are supported")
    ctypes.memset(ptr, 0, _CTRL_BYTES)
    _int(ptr, _GROUPS).value = int(groups)


def zenflow_adam_submit(
    ptr: int,
    now: int,
    step: int,
    lrs: Sequence[float],
    beta1s: Sequence[float],
    beta2s: Sequence[float],
    epss: Sequence[float],
    weight_decays: Sequence[float],
    bias_corrections: Sequence[int],
) -> None:
    for group, values in enumerate(zip(lrs, beta1s, beta2s, epss, weight_decays, bias_corrections)):
        for field, value in enumerate(values):
            _float(ptr, group, field).value = float(value)
    _int(ptr, _NOW).value = int(now)
    _int(ptr, _STEP).value = int(step)
    _int(ptr, _SUBMITTED).value += 1  # last: the worker reads the fields above once it sees this


def zenflow_adam_wait(ptr: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + float(timeout_s)
    taken, done = _int(ptr, _TAKEN), _int(ptr, _DONE)
    while done.value <= taken.value:
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)
    taken.value += 1
    return True


def zenflow_adam_ctrl_exit(ptr: int) -> None:
    _int(ptr, _EXIT).value = 1


def _worker_functions(adam_update: Callable[..., object]) -> tuple[Callable[..., Any], ...]:
    """The ZenFlow worker's side (create, register_group, run_worker, destroy), sharing one handle table."""
    workers: dict[int, dict[str, Any]] = {}

    def zenflow_adam_create(optimizer_id: int, affinity: Sequence[int] = ()) -> int:
        if affinity and hasattr(os, "sched_setaffinity"):
            try:
                os.sched_setaffinity(0, set(affinity))
            except OSError:
                pass  # best effort, as a pinning the machine refuses should not stop the optimizer
        handle = len(workers) + 1
        workers[handle] = {"optimizer": int(optimizer_id), "groups": []}
        return handle

    def zenflow_adam_register_group(handle: int, param: torch.Tensor, *buffers: torch.Tensor) -> None:
        if len(buffers) != 7:
            raise TypeError(
                "zenflow_adam_register_group(handle, param, grad0, grad1, exp_avg0, exp_avg1, exp_avg_sq0, "
                f"exp_avg_sq1, stale): got {len(buffers)} buffers after param"
            )
        workers[handle]["groups"].append((param, *buffers))

    def zenflow_adam_run_worker(handle: int, ptr: int) -> None:
        worker = workers[handle]
        submitted, done, stop = _int(ptr, _SUBMITTED), _int(ptr, _DONE), _int(ptr, _EXIT)
        while not stop.value:
            if submitted.value <= done.value:
                time.sleep(_POLL_S)
                continue
            target, now, step = submitted.value, _int(ptr, _NOW).value, _int(ptr, _STEP).value
            for group, (param, g0, g1, m0, m1, v0, v1, stale) in enumerate(worker["groups"]):
                lr, beta1, beta2, eps, decay, bias = (_float(ptr, group, f).value for f in range(_FIELDS))
                grad, m, v = (g0, m0, v0) if now == 0 else (g1, m1, v1)
                adam_update(worker["optimizer"], step, lr, beta1, beta2, eps, decay, bool(bias), param, grad, m, v)
                stale.copy_(param)
            done.value = target

    def zenflow_adam_destroy(handle: int) -> None:
        workers.pop(handle, None)

    return zenflow_adam_create, zenflow_adam_register_group, zenflow_adam_run_worker, zenflow_adam_destroy

"""The one place Slipstream touches private PyTorch APIs (docs/design.md P11), each with a note on why.

- `no_subclass_dispatch()`: run an op on tensor subclasses as plain tensors (the sharded parameter's
  `__torch_function__` uses it so op results stay plain tensors, as nn.Parameter's own disabled impl does).
- `queue_end_of_backward(callback)`: run `callback` when the current autograd backward pass finishes
  (ZeRO-3 reduces the remaining gradients and frees gathered parameters there). Only valid while a
  backward pass is running (inside an autograd hook).
- `storage_use_count(tensor)`: how many references hold the tensor's storage, or None where torch does not
  say (ZeRO-3 asks whether tensors taken inside GatheredParameters still alias a unit's gathered storage
  before releasing it).
- `swap_storage_memory(a, b)`: exchange the memory (and byte sizes) behind two tensors' storages, keeping each
  storage object and so every view of it (ZeRO-3 lends a unit's gathered storage a pooled buffer for the length
  of a gather, so views autograd saved in the forward see the backward's gather; zero/stage3/pool.py). False
  where torch cannot.
- `use_count(tensor)`: how many C++ references hold the tensor's TensorImpl (comm/inflight.py watches gloo's
  worker threads let go of a collective's tensors with it).
- `continue_stopped_ranks_on_close()`: the elastic agent follows the signal that stops a rank with SIGCONT,
  so a rank stopped by SIGSTOP ends with the job instead of after the agent's grace period (see the function);
  `pids_stopped_by_agent()` then says which ranks the agent signalled while they still ran.
- `drop_traceback_rank_prefix()`: undo the `[rank<N>]: ` prefix init_process_group's excepthook puts on each
  traceback line, where the launcher already prefixes every line of the rank's output.
- `live_groups()`: every process group torch.distributed has registered (the default one and subgroups).
- `backward_input(outputs, grads, inputs, weights)` / `backward_weight(weights, state)`: split one backward into
  the input-gradient part and the weight-gradient part (the zero-bubble schedules, pipe/runtime.py); torch's
  pipelining keeps the graph walk that saves the intermediates between them in a private module.
- `forget_destroyed_groups()`: drop the references `torch.distributed.nn.functional` keeps to destroyed
  groups, so a destroyed group can be freed and its worker threads joined (see the function).
"""

from __future__ import annotations

import os
import signal
import sys
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def no_subclass_dispatch() -> Any:
    return torch._C.DisableTorchFunctionSubclass()


def queue_end_of_backward(callback: Callable[[], None]) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(callback)  # type: ignore[attr-defined, unused-ignore]


def storage_use_count(tensor: torch.Tensor) -> int | None:
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return None
    storage = tensor.untyped_storage()
    return int(use_count(storage._cdata)) - 1  # without `storage`, the reference made here


CAN_SWAP_STORAGE_MEMORY = hasattr(torch.UntypedStorage, "_swap_data_ptr_")
"""Whether storages can trade their memory in place (torch 2.4 cannot); `swap_storage_memory` does nothing otherwise."""


def swap_storage_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    if not CAN_SWAP_STORAGE_MEMORY:
        return False
    a.untyped_storage()._swap_data_ptr_(b.untyped_storage())  # type: ignore[attr-defined, unused-ignore]
    return True


def use_count(tensor: torch.Tensor) -> int:
    return int(tensor._use_count())  # type: ignore[attr-defined]


def live_groups() -> list[Any]:
    world = getattr(dist.distributed_c10d, "_world", None)
    return list(getattr(world, "pg_map", {}) or {})


def forget_destroyed_groups() -> None:
    """Reset `group=` defaults of `torch.distributed.nn.functional` that hold a destroyed group to None.

    Its functions are declared `def broadcast(tensor, src, group=group.WORLD)`: the default is evaluated
    when the module is first imported, which is None before init_process_group and the group itself after.
    torch._dynamo imports it and every torch.optim optimizer imports torch._dynamo, so in a training script
    the default group ends up held by ten function defaults: destroy_process_group cannot free it, and its
    gloo worker threads live into interpreter finalization. None is what those defaults are when the module
    is imported before the group exists (the functions then use the default group of the moment).
    """
    module = sys.modules.get("torch.distributed.nn.functional")
    if module is None:
        return
    live = {id(group) for group in live_groups()}
    for value in vars(module).values():
        defaults = getattr(value, "__defaults__", None)
        if not isinstance(value, types.FunctionType) or not defaults:
            continue
        if any(isinstance(item, dist.ProcessGroup) and id(item) not in live for item in defaults):
            value.__defaults__ = tuple(
                None if isinstance(item, dist.ProcessGroup) and id(item) not in live else item for item in defaults
            )


def continue_stopped_ranks_on_close() -> None:
    """Patch torch's SubprocessHandler (in the launcher process only) so that the signal the elastic agent sends
    to stop a rank is followed by SIGCONT.

    A rank stopped by SIGSTOP (or a debugger) cannot act on SIGTERM: the signal stays pending and the agent
    waits its whole grace period (30 s in torch 2.13, whatever `shutdown_timeout` says) before SIGKILL. Once
    continued, the rank meets the pending SIGTERM at once, so a job with a stopped rank ends when the others do.
    """
    from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import SubprocessHandler

    if getattr(SubprocessHandler.close, "_slipstream", False):
        return
    original = SubprocessHandler.close

    def close(self: Any, death_sig: signal.Signals | None = None) -> None:
        if self.proc.poll() is None:
            _stopped_by_agent.add(self.proc.pid)
        original(self, death_sig)
        if os.name == "posix":
            try:
                os.killpg(self.proc.pid, signal.SIGCONT)
            except (ProcessLookupError, PermissionError):
                pass

    close._slipstream = True  # type: ignore[attr-defined]
    SubprocessHandler.close = close  # type: ignore[method-assign]


_stopped_by_agent: set[int] = set()


def pids_stopped_by_agent() -> frozenset[int]:
    """Pids of the ranks this launcher's elastic agent signalled to stop while they still ran (after another
    rank failed, or when the launcher was signalled). A rank in this set ended because the agent stopped it;
    one outside it ended on its own or by a signal from outside the job (an OOM killer, a scheduler)."""
    return frozenset(_stopped_by_agent)


def drop_traceback_rank_prefix() -> None:
    """Put back the excepthook that init_process_group wrapped (its `_distributed_excepthook` prefixes each
    line of an uncaught exception's traceback with `[rank<N>]: `). Under a launcher that already prefixes every
    line of the rank's output the traceback lines would carry the prefix twice. A hook that is not torch's is
    left alone."""
    hook: Any = sys.excepthook
    while getattr(getattr(hook, "__code__", None), "co_name", "") == "_distributed_excepthook":
        cells = dict(zip(hook.__code__.co_freevars, hook.__closure__ or ()))
        if "old_hook" not in cells:
            return
        hook = cells["old_hook"].cell_contents
        sys.excepthook = hook


def backward_input(
    outputs: list[torch.Tensor],
    grads: list[torch.Tensor] | None,
    inputs: list[torch.Tensor],
    weights: Iterable[nn.Parameter],
) -> Any:
    """Gradients of `inputs` only (set as their .grad); returns what `backward_weight` needs."""
    from torch.distributed.pipelining import _backward

    _, state = _backward.stage_backward_input(outputs, grads, inputs, iter(weights))
    return state


def backward_weight(weights: Iterable[nn.Parameter], state: list[dict[str, object]]) -> None:
    """The weight gradients of a split backward, added to each weight's .grad (no accumulation hooks run)."""
    from torch.distributed.pipelining import _backward

    _backward.stage_backward_weight(iter(weights), state)

"""The engine's `offload_states()` / `reload_states()` (DeepSpeed's names and arguments), mixed into the engine.

Between steps, a post-training loop (RLHF: generate with another engine, then train) moves the ZeRO states to
host memory to free the device, and brings them back before the next step. zero/state_buffers.py lists the
buffers and moves their storages ([Note: offloaded storage]); this mixin checks the arguments, refuses what it
cannot do, and blocks forward while the states are away.

On the CPU accelerator the "device" is host memory too: the states are still copied into separate host tensors
and their original storages released, so the engine's own buffers hold 0 bytes until `reload_states()`;
nothing is pinned there (pinning only helps copies to a separate device memory).
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Iterable

from torch import nn
from torch.utils.hooks import RemovableHandle

from slipstream.zero.optimizer import ZeroOptimizer
from slipstream.zero.stage3.model import ZeroModel
from slipstream.zero.state_buffers import HostCopies, OffloadStateTypeEnum, state_buffers

_DEVICES = ("cpu", "none", "nvme")


def _name(value: object) -> str:
    return str(value.value) if isinstance(value, enum.Enum) else str(value)


def _state_types(include: Iterable[object] | None) -> set[OffloadStateTypeEnum]:
    """`include` as state types (all of them when None); an unknown name is an error naming the valid ones."""
    if include is None:
        return set(OffloadStateTypeEnum)
    names = {_name(v) for v in include}
    valid = {kind.value for kind in OffloadStateTypeEnum}
    unknown = sorted(names - valid)
    if unknown:
        raise ValueError(
            f"engine.offload_states(include={sorted(names)}): unknown state type(s) {unknown}; use names of "
            f"OffloadStateTypeEnum: {sorted(valid)}, or include=None for all of them"
        )
    return {OffloadStateTypeEnum(name) for name in names}


class StateOffload:
    """`offload_states` / `reload_states`; the attributes it reads are the engine's."""

    optimizer: ZeroOptimizer | None
    zero_model: ZeroModel | None
    module: nn.Module

    def _host_copies(self) -> HostCopies:
        copies = self.__dict__.get("_offloaded_states")
        if copies is None:
            copies = HostCopies()
            self.__dict__["_offloaded_states"] = copies
        return copies

    def _offloadable(self) -> ZeroOptimizer:
        """The ZeRO optimizer whose states move; refuses an engine without one, or with ZeRO offload on."""
        optimizer = self.optimizer
        if optimizer is None:
            raise RuntimeError(
                "engine.offload_states() moves the ZeRO optimizer's states and this engine has no optimizer; "
                "pass optimizer= to initialize() or add an 'optimizer' section to the config"
            )
        if optimizer.offload.on_host or (self.zero_model is not None and self.zero_model.shards_in_host_memory):
            raise RuntimeError(
                "engine.offload_states(): the states already live in host memory or files "
                "(zero_optimization.offload_optimizer / offload_param is on); moving them again is not "
                "supported. Set offload_optimizer.device and offload_param.device to 'none' to use it"
            )
        return optimizer

    def offload_states(
        self,
        include: Iterable[object] | None = None,
        device: object = "cpu",
        pin_memory: bool = True,
        non_blocking: bool = False,
    ) -> None:
        """Move the ZeRO states named in `include` (OffloadStateTypeEnum; None: all) to host memory and release
        their device memory. `device`: "cpu" (DeepSpeed's OffloadDeviceEnum.cpu); "none" does nothing."""
        target = _name(device)
        if target not in _DEVICES:
            raise ValueError(f"engine.offload_states(device={target!r}): use 'cpu' (OffloadDeviceEnum.cpu)")
        if target == "nvme":
            raise ValueError("engine.offload_states(device='nvme'): NVMe is not supported here; use device='cpu'")
        kinds = _state_types(include)
        optimizer = self._offloadable()
        if target == "none":
            warnings.warn("engine.offload_states(device='none'): no device given, nothing was moved", stacklevel=2)
            return
        copies = self._host_copies()
        copies.offload(
            state_buffers(optimizer, self.zero_model), include=kinds, pin=pin_memory, non_blocking=non_blocking
        )
        if copies and "_offload_guard" not in self.__dict__:
            self.__dict__["_offload_guard"] = self.module.register_forward_pre_hook(_refuse_forward, prepend=True)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring back every state `offload_states()` moved; training continues exactly as without the trip."""
        self._offloadable()
        self._host_copies().reload(non_blocking=non_blocking)
        guard: RemovableHandle | None = self.__dict__.pop("_offload_guard", None)
        if guard is not None:
            guard.remove()

    def offloaded_state_types(self) -> set[OffloadStateTypeEnum]:
        """The state types now in host memory (empty after `reload_states()`)."""
        return set(self._host_copies().kinds)


def _refuse_forward(module: nn.Module, args: object) -> None:
    raise RuntimeError(
        "forward with the engine's states offloaded (engine.offload_states()): the parameters, gradients or "
        "optimizer states are in host memory; call engine.reload_states() first"
    )

"""The device buffers of a ZeRO optimizer (and its stage-3 model) by state type, and their trip to host memory.

`engine.offload_states()` / `reload_states()` (engine/offload_states.py) move them; this module knows where
they are. The state types are DeepSpeed's (`OffloadStateTypeEnum`):
- `lp_params`: the parameters in the model dtype: the flat params (stages 0-2), the unit shards and the full
  buffers of gathered units (stage 3).
- `hp_params`: the fp32 masters, where they are a buffer of their own (they alias the parameters when the
  model dtype is the master dtype: then they travel with `lp_params`).
- `lp_grads`: the gradient storage (full-size at stages 0-1, the owned shard at stages 2-3).
- `contiguous_grad_buffer`: the reusable communication buffers (the reduce-scatter staging ring, stage 3's
  gather pool). Scratch: their contents are not kept, they are only released and allocated again.
- `optim_states`: the tensors of the wrapped optimizer's state (Adam's moments and step counts).

[Note: offloaded storage] A buffer is moved by its storage, not by its tensor: the bytes are copied into a
separate host tensor (pinned where the accelerator pins) and the device storage is resized to 0 bytes, so the
memory is released while every view of it (parameters' `.data`, master pieces, `.grad` links, the optimizer's
param groups) stays attached. Reload grows the same storage again and copies the bytes back: every view sees
exactly the values it had, so training after the round trip is bit-equal to training without it. Reading a
view while its storage is released is an error (or, on the CPU, a crash), so the engine refuses forward until
the states are back.
"""

from __future__ import annotations

import dataclasses
import enum

import torch

from slipstream.zero.optimizer import ZeroOptimizer
from slipstream.zero.stage3.model import ZeroModel
from slipstream.zero.staging import StagingRing


class OffloadStateTypeEnum(str, enum.Enum):
    """DeepSpeed's names of the engine states `offload_states(include=...)` moves (see the module doc)."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


SCRATCH = frozenset({OffloadStateTypeEnum.contiguous_grad_buffer})
"""State types whose contents are not kept: released on offload, allocated again (uninitialised) on reload."""


def state_buffers(
    optimizer: ZeroOptimizer, zero_model: ZeroModel | None
) -> dict[OffloadStateTypeEnum, list[torch.Tensor]]:
    """Every buffer of `optimizer` and `zero_model` by state type (views and aliases included: the caller
    moves each storage once, under the first type that names it)."""
    kinds = OffloadStateTypeEnum
    found: dict[OffloadStateTypeEnum, list[torch.Tensor]] = {kind: [] for kind in kinds}
    for group in optimizer.groups:
        flat_params = getattr(group, "flat_params", None)  # stages 0-2; stage 3's parameters live in the units
        if isinstance(flat_params, torch.Tensor):
            found[kinds.lp_params].append(flat_params)
        found[kinds.hp_params] += group.master_buffers
        found[kinds.lp_grads].append(group.grad_storage)
    if zero_model is not None:
        for unit in zero_model.units:
            found[kinds.lp_params] += [unit.shard, unit.full]
        found[kinds.contiguous_grad_buffer] += zero_model.pool.free_buffers()
    found[kinds.contiguous_grad_buffer] += _staging_buffers(optimizer)
    for state in optimizer.optimizer.state.values():
        found[kinds.optim_states] += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return found


def _staging_buffers(optimizer: ZeroOptimizer) -> list[torch.Tensor]:
    """The buffers of the staging rings the optimizer holds (stages 2-3 directly; stages 0-1 through their step
    reducer, when gradients travel in another dtype), found among its attributes."""
    out: list[torch.Tensor] = []
    for value in vars(optimizer).values():
        ring = value if isinstance(value, StagingRing) else getattr(value, "ring", None)
        if isinstance(ring, StagingRing):
            out += [*ring.staging, *ring.receive]
    return out


@dataclasses.dataclass(slots=True)
class _Moved:
    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None  # None: scratch, nothing to copy back


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over all of `storage` (a view: writing it writes the storage)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class HostCopies:
    """The storages moved to host memory, in the order they were moved. See [Note: offloaded storage]."""

    def __init__(self) -> None:
        self._moved: list[_Moved] = []  # a storage moved once has 0 bytes: a later call passes it by
        self.kinds: set[OffloadStateTypeEnum] = set()

    def __bool__(self) -> bool:
        return bool(self._moved)

    def offload(
        self,
        buffers: dict[OffloadStateTypeEnum, list[torch.Tensor]],
        *,
        include: set[OffloadStateTypeEnum],
        pin: bool,
        non_blocking: bool,
    ) -> int:
        """Move the storages of the `include`d types (each once) to host copies and release them; returns the
        bytes released."""
        from slipstream.accelerator import get_accelerator

        released = 0
        seen: set[int] = set()
        for kind, tensors in buffers.items():
            for tensor in tensors:
                storage = tensor.untyped_storage()
                address, nbytes = storage.data_ptr(), storage.nbytes()
                if nbytes == 0 or address in seen:
                    continue
                seen.add(address)
                if kind not in include:
                    continue
                host = None
                if kind not in SCRATCH:
                    host = torch.empty(nbytes, dtype=torch.uint8, device="cpu")
                    host = get_accelerator().pin_memory(host) if pin else host
                    host.copy_(_bytes_of(storage), non_blocking=non_blocking)
                storage.resize_(0)
                self._moved.append(_Moved(storage=storage, nbytes=nbytes, host=host))
                self.kinds.add(kind)
                released += nbytes
        return released

    def reload(self, *, non_blocking: bool) -> int:
        """Grow every released storage again and copy its bytes back; returns the bytes restored."""
        restored = 0
        for moved in self._moved:
            moved.storage.resize_(moved.nbytes)
            if moved.host is not None:
                _bytes_of(moved.storage).copy_(moved.host, non_blocking=non_blocking)
            restored += moved.nbytes
        self._moved.clear()
        self.kinds.clear()
        return restored

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory the copies hold."""
        return sum(m.host.numel() for m in self._moved if m.host is not None)

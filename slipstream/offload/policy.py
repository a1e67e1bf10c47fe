"""Offload policies, chosen by type (docs/design.md D3): where the fp32 master pieces, their gradients and the
optimizer state live, and how host buffers are allocated.

- `NoOffload`: everything stays on the parameters' device; master pieces may alias the parameters.
- `CPUOffload` (ZeRO-Offload, `offload_optimizer.device: cpu`): master pieces, their gradients, the
  optimizer state and a low-precision staging buffer live in host memory, pinned when `pin_memory` is on
  and the pinned total stays under half of the host's available memory (else pageable, with a warning).
  Gradients go device -> host before the step; the CPU Adam op updates the master pieces and writes the
  new values in the parameter dtype into the staging buffer in the same pass; that buffer goes host ->
  device. All copies go through the accelerator layer, so on GPUs they are real transfers; on the CPU
  accelerator host and device are the same memory and the policy is exercised for correctness.
- `NVMeOffload` (offload/nvme.py): CPU offload whose masters and optimizer states are swapped to files; it
  overrides the step hooks below, so the ZeRO step has no NVMe branches.

One policy class per offload target, for the optimizer (`offload_optimizer`) and for stage 3's parameter shards
(`offload_param`) alike: `policy_for` (choose.py) is the one place a plan's target becomes its class. The plan
keeps plain target types (config/plan.py: `NoOffloadTarget`, `CpuTarget`, `NvmeTarget`) because config/ is a
leaf layer that may not import offload/; each policy is built from its target with `from_target` and carries
every decision that depends on the target: where shards and masters live (`master_device`, `host_resident`),
whether host buffers are pinned (`pins`), the parameter shard store (`make_param_store`) and what the planner
counts (`on_host`, `in_files`).

The ZeRO optimizer calls three hooks of its policy (see `SteppedGroups`): `prepare` once its buffers exist,
`run_step` for the update, and `resident` around checkpoint reads and writes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import Any, ClassVar, Protocol

import torch

from slipstream.config.plan import CpuTarget, OffloadTarget
from slipstream.utils.logging import warn_once

_PIN_FRACTION = 0.5


def host_available_bytes() -> int:
    """Host memory available to new allocations (MemAvailable), or 0 when unknown."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


class SteppedGroups(Protocol):
    """What a policy may ask of the ZeRO optimizer it serves: its sub-groups, one at a time (stage 3 cuts each
    param group into sub-groups of `zero_optimization.sub_group_size` elements; below stage 3 a param group is
    one sub-group)."""

    @property
    def num_sub_groups(self) -> int: ...

    def sub_group_numel(self, index: int) -> int:
        """Master elements of sub-group `index` (Adam keeps two fp32 states of that size)."""
        ...

    def swappable(self, index: int) -> list[tuple[torch.Tensor, str]]:
        """Sub-group `index`'s full-size host tensors (master buffer, optimizer states) with a stable name each."""
        ...

    def step_sub_group(self, index: int) -> None:
        """Update sub-group `index` and copy its new values into the parameters."""
        ...

    def step_all(self) -> None:
        """Update every group (the new values reach the parameters in the optimizer's publish phase)."""
        ...


class ParamStore(Protocol):
    """Where stage 3's parameter shards live between uses when not in memory (zero/stage3/unit.py's ShardStore
    interface; offload/nvme.py's NVMeShardStore)."""

    in_memory: bool

    def fetch(self, shard: torch.Tensor) -> None: ...

    def release(self, shard: torch.Tensor, *, dirty: bool) -> None: ...

    def discard(self, shard: torch.Tensor) -> None: ...


class OffloadPolicy:
    """No offload: master weights, optimizer state and parameter shards live with the parameters."""

    on_host: bool = False
    """Offloaded tensors are handled on the host (CPU and NVMe): the step runs there, shards are staged there."""
    in_files: ClassVar[bool] = False
    """Offloaded tensors live in files between uses (NVMe); the planner counts them on the disk."""

    @classmethod
    def from_target(cls, target: OffloadTarget, *, rank: int, section: str) -> OffloadPolicy:
        """The policy of a plan's `target` on `rank`; `section` ("offload_optimizer" or "offload_param") is the
        config section it came from, named in errors. Builds nothing on disk."""
        return cls()

    @property
    def swaps_gradients(self) -> bool:
        """NVMe offload: stage 3's gradient shards live in files per sub-group (offload/grad_swap.py)."""
        return False

    @property
    def host_resident(self) -> bool:
        """Offloaded tensors stay in host memory between uses (CPU offload; NVMe's are in files)."""
        return self.on_host and not self.in_files

    @property
    def pins(self) -> bool:
        """Host buffers of this policy are pinned (page-locked) memory."""
        return self.pins_with(False)

    def pins_with(self, requested: bool) -> bool:
        """Whether host buffers are pinned when a caller also asks for pinning (zero.Init's `pin_memory`)."""
        return requested

    @classmethod
    def pins_configured(cls, pin_memory: bool) -> bool:
        """Whether this policy's host buffers are pinned when its section sets `pin_memory` (the planner counts
        the pinned allocator's rounding only then; no instance needed)."""
        return pin_memory

    def make_param_store(self, *, role: str = "params") -> ParamStore | None:
        """Where stage 3's parameter shards live between uses when not in memory (None: they stay in memory);
        `role` names the store's directory."""
        return None

    def master_device(self, param_device: torch.device) -> torch.device:
        return param_device

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device=device)

    # ---- step hooks (overridden by NVMeOffload) ----
    def settle(self, tensors: list[tuple[torch.Tensor, str]]) -> None:
        """`tensors` (a sub-group's masters, just filled) are complete; NVMe offload writes them out now."""

    def prepare(self, groups: SteppedGroups) -> None:
        """Called once the optimizer's buffers and states exist."""

    def run_step(self, groups: SteppedGroups) -> bool:
        """The update; returns True when the new values are already in the flat parameters."""
        groups.step_all()
        return False

    @contextlib.contextmanager
    def resident(self, groups: SteppedGroups) -> Iterator[None]:
        """Masters and optimizer states in memory for the block (checkpoints)."""
        yield

    def resident_master_bytes(self, master_bytes: list[int]) -> int:
        """Bytes of the masters in memory at once during a step, given each sub-group's master bytes."""
        return sum(master_bytes)

    def resident_grad_bytes(self, grad_bytes: list[int]) -> int:
        """Bytes of swapped gradient buffers in memory at once, given each sub-group's (0 when none are swapped)."""
        return 0

    def swap_gradients(self, buffers: list[tuple[torch.Tensor, str]]) -> Any:
        """Take stage 3's per-sub-group gradient buffers into files (`NVMeOffload`); a policy with
        `swaps_gradients` False is never asked."""
        raise NotImplementedError(f"{type(self).__name__} keeps gradients in memory; it does not swap them")


NoOffload = OffloadPolicy


@dataclasses.dataclass
class CPUOffload(OffloadPolicy):
    """Master weights, gradients for the step and optimizer state in host memory (see module doc)."""

    pin_memory: bool = True
    """The configured `pin_memory`; `pins` says whether buffers are pinned."""
    pinned_bytes: int = 0
    on_host: bool = dataclasses.field(default=True, init=False)

    @classmethod
    def from_target(cls, target: OffloadTarget, *, rank: int, section: str) -> OffloadPolicy:
        assert isinstance(target, CpuTarget), f"{cls.__name__} is the policy of CpuTarget, not {target!r}"
        return cls(pin_memory=target.pin_memory)

    def pins_with(self, requested: bool) -> bool:
        return requested or self.pin_memory

    def master_device(self, param_device: torch.device) -> torch.device:
        return torch.device("cpu")

    def allocate(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        tensor = torch.zeros(numel, dtype=dtype, device="cpu")
        if not self.pins:
            return tensor
        size = numel * tensor.element_size()
        available = host_available_bytes()
        if available and self.pinned_bytes + size > _PIN_FRACTION * available:
            warn_once(
                "offload-pin",
                f"slipstream: pinning {(self.pinned_bytes + size) / 2**30:.2f} GiB would exceed "
                f"half of the host's available {available / 2**30:.2f} GiB; using pageable memory for the "
                "rest (set offload_optimizer.pin_memory false to silence this)",
            )
            return tensor
        from slipstream.accelerator import get_accelerator

        self.pinned_bytes += size
        return get_accelerator().pin_memory(tensor)

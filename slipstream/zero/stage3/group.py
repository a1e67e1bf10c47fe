"""How stage 3's optimizer sees the shards: each unit's trainable parameters cut into *runs*, and one
`Stage3Group` per optimizer param group holding the runs' master pieces and gradient shards.

A run is consecutive trainable parameters of one unit in the same param group (contiguous in the unit's shard),
never larger than a sub-group (`zero_optimization.sub_group_size`); the wrapped torch optimizer sees one master
piece per run. See zero/stage3/optimizer.py for how gradients reach the groups and how they are stepped.
"""

from __future__ import annotations

import dataclasses

import torch

from slipstream.offload.policy import OffloadPolicy
from slipstream.zero.master_group import MasterGroup
from slipstream.zero.stage3.unit import Unit


@dataclasses.dataclass(frozen=True, slots=True)
class Run:
    """Consecutive trainable parameters `indices` of `unit`: `numel` elements of its shard from `shard_start`,
    and of its reduce-scatter output from `receive_start`."""

    unit: Unit
    indices: tuple[int, ...]
    shard_start: int
    numel: int
    receive_start: int


def _pack(runs: list[Run], limit: int) -> list[tuple[int, int]]:
    """Consecutive runs, in order, packed into sub-groups of at most `limit` elements ([start, end) ranges of
    run indices); a run larger than `limit` is a sub-group of its own."""
    spans: list[tuple[int, int]] = []
    start, size = 0, 0
    for index, run in enumerate(runs):
        if index > start and size + run.numel > limit:
            spans.append((start, index))
            start, size = index, 0
        size += run.numel
    if runs:
        spans.append((start, len(runs)))
    return spans


def in_memory(tensor: torch.Tensor) -> bool:
    """False for a view of a swapped-out buffer (NVMe offload: its storage has no bytes between uses)."""
    return tensor.numel() == 0 or tensor.untyped_storage().nbytes() > 0


class Stage3Group(MasterGroup):
    """One optimizer param group's view of the shards: master pieces, gradient shards, host buffers."""

    def __init__(
        self,
        runs: list[Run],
        *,
        device: torch.device,
        master_dtype: torch.dtype,
        grad_dtype: torch.dtype,
        offload: OffloadPolicy,
        sub_group_numel: int,
    ) -> None:
        self.runs, self.device, self.offload = runs, device, offload
        total = sum(r.numel for r in runs)
        self.dtype = runs[0].unit.dtype
        # the masters are views of the shards when both have the same dtype in the same memory: no offload, or
        # host offload on the CPU accelerator with the shards in memory (not in NVMe files)
        self.aliased_master = master_dtype == self.dtype and (
            not offload.on_host or (device.type == "cpu" and all(r.unit.store.in_memory for r in runs))
        )
        self.master_flat: torch.Tensor | None = None
        self._sub_groups = _pack(runs, sub_group_numel)
        self._master_buffers: list[torch.Tensor] = []
        if self.aliased_master:
            self.master_pieces = [r.unit.shard[r.shard_start : r.shard_start + r.numel] for r in runs]
        else:
            # one buffer per sub-group, filled and handed to the policy one at a time: with NVMe offload only
            # one sub-group's masters are ever in memory while they are built
            self.master_pieces = []
            for start, end in self._sub_groups:
                buffer = offload.allocate(
                    sum(r.numel for r in runs[start:end]), master_dtype, offload.master_device(device)
                )
                offset = 0
                for run in runs[start:end]:
                    piece = buffer[offset : offset + run.numel]
                    offset += run.numel
                    run.unit.store.fetch(run.unit.shard)  # NVMe-resident shards: read in, copied, released
                    piece.copy_(run.unit.shard[run.shard_start : run.shard_start + run.numel])
                    run.unit.store.release(run.unit.shard, dirty=False)
                    self.master_pieces.append(piece)
                offload.settle([(buffer, "master")])
                self._master_buffers.append(buffer)
            if len(self._master_buffers) == 1:
                self.master_flat = self._master_buffers[0]
        # NVMe offload with the gradients in host memory of the master dtype (the CPU accelerator): one gradient
        # buffer per sub-group, kept in files between uses ([Note: swapped gradients], offload/grad_swap.py)
        self.grad_buffers: list[torch.Tensor] = []
        if offload.swaps_gradients and device.type == "cpu" and grad_dtype == master_dtype:
            self.owned_grads = []
            for start, end in self._sub_groups:
                buffer = torch.empty(sum(r.numel for r in runs[start:end]), dtype=grad_dtype, device=device)
                self.owned_grads += self._split(buffer, runs[start:end])
                buffer.untyped_storage().resize_(0)  # never resident here: the swap allocates it when used
                self.grad_buffers.append(buffer)
            self.grad_storage = torch.empty(0, dtype=grad_dtype, device=device)
        else:
            self.grad_storage = torch.zeros(total, dtype=grad_dtype, device=device)
            self.owned_grads = self._split(self.grad_storage)
        self._allocate_host_buffers(total, master_dtype)

    @property
    def master_buffers(self) -> list[torch.Tensor]:
        return self._master_buffers

    @property
    def sub_groups(self) -> list[tuple[int, int]]:
        return self._sub_groups

    def _split(self, flat: torch.Tensor, runs: list[Run] | None = None) -> list[torch.Tensor]:
        pieces, offset = [], 0
        for run in self.runs if runs is None else runs:
            pieces.append(flat[offset : offset + run.numel])
            offset += run.numel
        return pieces

    def owned_bytes(self) -> dict[str, int]:
        total = super().owned_bytes()
        total["grads"] += sum(b.numel() * b.element_size() for b in self.grad_buffers)  # swapped, but owned
        return total

    def copy_master_to_params(self, *, from_low_precision: bool, span: tuple[int, int] | None = None) -> None:
        """The updated masters (or the optimizer's low-precision copy) of pieces [span) into the shards."""
        if self.aliased_master:
            return
        source = self.low_precision_pieces if from_low_precision else self.master_pieces
        start, end = span if span is not None else (0, len(self.runs))
        for run, piece in zip(self.runs[start:end], source[start:end]):
            run.unit.store.fetch(run.unit.shard)
            run.unit.shard[run.shard_start : run.shard_start + run.numel].copy_(
                piece, non_blocking=self.offload.on_host
            )
            run.unit.store.release(run.unit.shard, dirty=True)


@dataclasses.dataclass(frozen=True, slots=True)
class UnitRuns:
    """One unit's trainable parameters as the optimizer takes them."""

    indices: list[int]
    """Positions in `unit.params` of the trainable parameters."""
    receive_offsets: list[int]
    """Where each of them starts in the unit's reduce-scatter output (this rank's columns)."""
    receive_numel: int
    runs: list[Run]


def cut_runs(unit: Unit, group_of: dict[int, int], sub_group_numel: int) -> UnitRuns:
    """Cut `unit`'s trainable parameters (`group_of`: id -> param group number) into runs: a run ends at a frozen
    parameter, a change of param group, or where it would grow past `sub_group_numel` elements."""
    indices = [i for i, p in enumerate(unit.params) if id(p) in group_of]
    offsets, receive = [], 0
    for index in indices:
        offsets.append(receive)
        receive += unit.layout.shard_numels[index]
    runs: list[Run] = []
    current: list[int] = []
    current_numel = 0
    for index in indices + [-1]:
        numel = unit.layout.shard_numels[index] if index >= 0 else 0
        if current and (
            index < 0
            or index != current[-1] + 1
            or group_of[id(unit.params[index])] != group_of[id(unit.params[current[0]])]
            or current_numel + numel > sub_group_numel  # a run never spans two sub-groups
        ):
            first = current[0]
            runs.append(
                Run(
                    unit=unit,
                    indices=tuple(current),
                    shard_start=unit.layout.shard_offsets[first],
                    numel=current_numel,
                    receive_start=offsets[indices.index(first)],
                )
            )
            current, current_numel = [], 0
        if index >= 0:
            current.append(index)
            current_numel += numel
    return UnitRuns(indices=indices, receive_offsets=offsets, receive_numel=receive, runs=runs)

"""`SubGroupStepping`: the ZeRO optimizer as its offload policy sees it (offload/policy.py, `SteppedGroups`).

The policy steps the optimizer whole (`step_all`) or one sub-group at a time (`step_sub_group`, NVMe offload
swapping each sub-group's masters and states in and out around it). Below stage 3 a param group is one
sub-group; stage 3 cuts each into sub-groups of `zero_optimization.sub_group_size` elements. When the wrapped
optimizer is the CPU Adam op, it writes the new low-precision values into host buffers in the same pass
(`_low_precision_out`), which are copied into the parameters in place of the masters.
"""

from __future__ import annotations

from typing import Any

import torch

from slipstream.precision.masters import NearestRounding


class SubGroupStepping:
    """Mixed into ZeroOptimizer, which sets `optimizer`, `groups` and the low-precision targets."""

    optimizer: torch.optim.Optimizer
    groups: list[Any]
    _low_precision_out: list[torch.Tensor]
    """Host buffers the CPU Adam op writes the new low-precision values into (empty: none), fixed for life."""
    _low_precision_by_group: list[list[torch.Tensor]]
    master_rounding: NearestRounding
    """How the step stores the new values of low-precision masters (precision/masters.py)."""

    @property
    def sub_groups(self) -> list[tuple[int, int, int]]:
        """(group number, first piece, end piece) of every sub-group, in stepping order."""
        return [(number, start, end) for number, flat in enumerate(self.groups) for start, end in flat.sub_groups]

    @property
    def num_sub_groups(self) -> int:
        return len(self.sub_groups)

    def sub_group_numel(self, index: int) -> int:
        number, start, end = self.sub_groups[index]
        return sum(piece.numel() for piece in self.groups[number].master_pieces[start:end])

    def step_all(self) -> None:
        self._step_optimizer(self._low_precision_out)

    def step_sub_group(self, index: int) -> None:
        """Update one sub-group's master pieces and copy their new values into the parameters."""
        self.step_pieces(*self.sub_groups[index])

    def step_pieces(self, number: int, start: int, end: int) -> None:
        """Update master pieces [start, end) of param group `number` (the optimizer's group cut down to them) and
        copy their new values into the parameters."""
        groups = list(self.optimizer.param_groups)
        group = groups[number]
        self.optimizer.param_groups = [{**group, "params": group["params"][start:end]}]
        try:
            low_precision = self._low_precision_by_group[number]
            self._step_optimizer(low_precision[start:end] if low_precision else [])
        finally:
            for key, value in self.optimizer.param_groups[0].items():  # what the step changed (its counters)
                if key != "params":
                    group[key] = value
            self.optimizer.param_groups = groups
        self.groups[number].copy_master_to_params(from_low_precision=bool(self._low_precision_out), span=(start, end))

    def swappable(self, index: int) -> list[tuple[torch.Tensor, str]]:
        """One sub-group's full-size host tensors (its master buffer, its pieces' optimizer states), named."""
        number, start, end = self.sub_groups[index]
        flat = self.groups[number]
        tensors = []
        position = [s for s, _ in flat.sub_groups].index(start)
        if flat.master_buffers:
            tensors.append((flat.master_buffers[position], f"group{number}_master"))
        for piece in flat.master_pieces[start:end]:
            for key, value in self.optimizer.state.get(piece, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    tensors.append((value, f"group{number}_{key}"))
        return tensors

    def _step_optimizer(self, low_precision: list[torch.Tensor]) -> None:
        if low_precision:
            host_kernel: Any = self.optimizer  # writes the low-precision copy in the same pass
            host_kernel.step(low_precision_out=low_precision)
        else:
            self.master_rounding.step(self.optimizer)

    def _low_precision_targets(self) -> list[torch.Tensor]:
        """Host buffers for the CPU Adam op to write the new low-precision values into, in the same pass."""
        writes_copy = getattr(type(self.optimizer), "writes_low_precision_copy", False)
        if not writes_copy or not all(f.low_precision_pieces for f in self.groups):
            return []
        return [p for flat in self.groups for p in flat.low_precision_pieces]

    def _split_by_group(self, low_precision: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        outs, start = [], 0
        for group in self.optimizer.param_groups:
            outs.append(low_precision[start : start + len(group["params"])] if low_precision else [])
            start += len(group["params"])
        return outs

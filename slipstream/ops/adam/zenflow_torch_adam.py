"""ZenFlow's selective AdamW: AdamW applied to the chosen columns of each weight only.

ZenFlow (DeepSpeed's `zero_optimization.zenflow`) splits a step in two: the few columns of each 2-D weight
whose gradients matter most are updated at once, on the compute device, by this optimizer; the rest wait and
are updated every few steps by the offloaded CPU Adam. The caller (ZenFlow's ZeRO optimizer, or a test)
talks to this optimizer through attributes it sets on each parameter, DeepSpeed's protocol:

- `selected_indices`: the chosen column indices (a 1-D integer tensor; 1-D parameters are taken whole).
- `selected_grad`: the gradient of those columns, shaped like the selection (`(rows, k)` at stages 1-2,
  `(k, rows)` at stage 3); the optimizer sets it to None once used.
- `temp_selected_param`: an optional snapshot of the selected columns; when present it is written back into
  the parameter before the update (the CPU update of the whole partition must not overwrite the columns this
  optimizer owns), then set to None.
- offload mode (`offload=True`): the selected columns' moments live on the host in `exp_avg_cpu_data` /
  `exp_avg_sq_cpu_data`; `copy_mv_from_cpu` brings them to the device as `exp_avg` / `exp_avg_sq` and
  `copy_mv_to_cpu` writes them back. Without offload they are ordinary optimizer state.

`ZenFlowSelectiveAdamW_stage3` reads each parameter's ZeRO-3 partition instead: `ds_tensor` holds the weight
transposed (`ds_shape` is `(columns, rows)`), so a column is a row of the partition from
`complete_column_offset` over `complete_numel` elements. A partition swapped out to NVMe (`ds_tensor.data` a
0-dim placeholder, `param.nvme_swapper` set) is swapped in, updated and swapped out one parameter at a time.

The update is torch's AdamW (decoupled weight decay, bias correction by the state's own step count), written
out so that it runs on any slice; with every column selected it equals `torch.optim.AdamW`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["ZenFlowSelectiveAdamW", "ZenFlowSelectiveAdamW_stage3", "adamw_update"]

_log = logging.getLogger(__name__)


@torch.no_grad()
def adamw_update(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    step: Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    max_exp_avg_sq: Tensor | None = None,
) -> None:
    """One AdamW update of `param` in place (torch.optim.AdamW's math); `step` (a 0-dim tensor) advances by 1."""
    step += 1
    t = float(step.item())
    grad = grad.to(param.dtype)
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    second = exp_avg_sq
    if max_exp_avg_sq is not None:
        torch.maximum(max_exp_avg_sq, exp_avg_sq, out=max_exp_avg_sq)
        second = max_exp_avg_sq
    bias1 = 1 - beta1**t
    bias2_sqrt = math.sqrt(1 - beta2**t)
    denom = (second.sqrt() / bias2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bias1)


class _SelectiveAdamW(torch.optim.AdamW):
    """What both layouts share: the attribute protocol, the state, buckets and the update loop.

    Subclasses say how the selected columns are read from and written to a parameter (`_read`, `_write`) and
    how the caller hands over parameters to `group_step`.
    """

    def __init__(self, params: Any, *args: Any, offload: bool = False, bucket_size: float = 5e8, **kwargs: Any):
        super().__init__(params, *args, **kwargs)
        self.offload = bool(offload)
        self.bucket_size = bucket_size
        # DeepSpeed binds `step` per instance; callers compare `opt.step` with these methods.
        self.step = self._step_with_offload if self.offload else self._step_without_offload  # type: ignore[method-assign]

    def step(self, closure: object = None) -> None:  # type: ignore[override]
        """The update of every parameter with a `selected_grad` (`_step_with_offload` in offload mode, else
        `_step_without_offload`; each instance binds `step` to one of them, as DeepSpeed does)."""
        if self.offload:
            self._step_with_offload()
        else:
            self._step_without_offload()

    # -- layout (subclasses) -------------------------------------------------------------------------------
    def _read(self, param: Tensor) -> Tensor:
        """A copy of the selected columns on the gradient's device, shaped like `selected_grad`."""
        raise NotImplementedError

    def _write(self, param: Tensor, value: Tensor) -> None:
        """Store `value` (shaped like `_read`'s result) back into the selected columns."""
        raise NotImplementedError

    def _snapshot_of(self, param: Tensor) -> Tensor:
        return self._read(param).clone()

    # -- NVMe partitions (stage 3 only; stage 1-2 parameters are always resident) ----------------------------
    def _swap_in(self, param: Tensor) -> bool:
        return False

    def _swap_out(self, param: Tensor, swapped_in: bool, *, changed: bool) -> None:
        return None

    # -- moments ---------------------------------------------------------------------------------------------
    def copy_mv_from_cpu(self, params: Iterable[Tensor]) -> None:
        """Offload mode: bring each parameter's host moments to its device as `exp_avg` / `exp_avg_sq`."""
        for param in params:
            device = _compute_device(param)
            param.exp_avg = param.exp_avg_cpu_data.to(device, non_blocking=True)  # type: ignore[attr-defined]
            param.exp_avg_sq = param.exp_avg_sq_cpu_data.to(device, non_blocking=True)  # type: ignore[attr-defined]

    def copy_mv_to_cpu(self, params: Iterable[Tensor]) -> None:
        """Offload mode: write `exp_avg` / `exp_avg_sq` back to the host buffers and drop the device copies."""
        for param in params:
            host_m, host_v = param.exp_avg_cpu_data, param.exp_avg_sq_cpu_data  # type: ignore[attr-defined]
            host_m.copy_(param.exp_avg.reshape(host_m.shape), non_blocking=True)  # type: ignore[attr-defined]
            host_v.copy_(param.exp_avg_sq.reshape(host_v.shape), non_blocking=True)  # type: ignore[attr-defined]
            param.exp_avg = None  # type: ignore[attr-defined]
            param.exp_avg_sq = None  # type: ignore[attr-defined]

    def clear_selected_mv(self) -> None:
        """Zero the moments of every parameter updated so far (a new column selection starts afresh).

        The step counts are kept, as DeepSpeed keeps them: bias correction goes on from the step reached.
        """
        _log.debug("ZenFlow: clearing the selective optimizer's moments")
        for group in self.param_groups:
            for param in group["params"]:
                state = self.state.get(param)
                if not state:
                    continue
                if self.offload:
                    param.exp_avg_cpu_data.zero_()
                    param.exp_avg_sq_cpu_data.zero_()
                else:
                    state["exp_avg"].zero_()
                    state["exp_avg_sq"].zero_()
                if "max_exp_avg_sq" in state:
                    state["max_exp_avg_sq"].zero_()

    # -- the update ------------------------------------------------------------------------------------------
    def _update_one(self, param: Tensor, group: Mapping[str, Any]) -> None:
        """Restore a pending snapshot, run AdamW on the selected columns, store them, consume the gradient."""
        swapped_in = self._swap_in(param)
        selected = self._read(param)
        snapshot = getattr(param, "temp_selected_param", None)
        if snapshot is not None:
            selected.copy_(snapshot.reshape(selected.shape))
        grad = param.selected_grad  # type: ignore[attr-defined]
        if grad.shape != selected.shape:
            raise ValueError(
                f"ZenFlow: a parameter's selected_grad has shape {tuple(grad.shape)} but its "
                f"{len(param.selected_indices) if hasattr(param, 'selected_indices') else '?'} selected columns "
                f"have shape {tuple(selected.shape)}; set selected_grad to the gradient of the selected columns"
            )
        state = self.state[param]
        if len(state) == 0:
            state["step"] = torch.zeros((), dtype=torch.float32)
        if group["amsgrad"] and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = torch.zeros_like(selected)
        if self.offload:
            if getattr(param, "exp_avg", None) is None:
                self.copy_mv_from_cpu([param])
                own_copy = True
            else:
                own_copy = False
            exp_avg = param.exp_avg.view_as(selected)  # type: ignore[attr-defined]
            exp_avg_sq = param.exp_avg_sq.view_as(selected)  # type: ignore[attr-defined]
        else:
            if "exp_avg" not in state:
                state["exp_avg"] = torch.zeros_like(selected)
                state["exp_avg_sq"] = torch.zeros_like(selected)
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        beta1, beta2 = group["betas"]
        adamw_update(
            selected,
            grad.to(selected.device),
            exp_avg,
            exp_avg_sq,
            state["step"],
            lr=float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            max_exp_avg_sq=state.get("max_exp_avg_sq"),
        )
        self._write(param, selected)
        if self.offload and own_copy:
            self.copy_mv_to_cpu([param])
        self._swap_out(param, swapped_in, changed=True)
        param.temp_selected_param = None  # type: ignore[attr-defined]
        param.selected_grad = None  # type: ignore[attr-defined]

    def _update(self, params: Sequence[Tensor], group: Mapping[str, object]) -> None:
        for param in params:
            if _has_selection(param):
                self._update_one(param, group)

    @torch.no_grad()
    def _step_without_offload(self, closure: object = None) -> None:
        """Update the selected columns of every parameter that has a `selected_grad`."""
        for group in self.param_groups:
            self._update(group["params"], group)

    @torch.no_grad()
    def _step_with_offload(self, closure: object = None) -> None:
        """Offload mode: the same update, `bucket_size` elements at a time (moments on the device per bucket)."""
        for group_id, group in enumerate(self.param_groups):
            bucket: list[Tensor] = []
            numel = 0
            for param in group["params"]:
                if not _has_selection(param):
                    continue
                bucket.append(param)
                numel += param.numel()
                if numel >= self.bucket_size:
                    self._bucket_step(group_id, bucket)
                    bucket, numel = [], 0
            if bucket:
                self._bucket_step(group_id, bucket)

    def _bucket_step(self, group_id: int, bucket: list[Tensor]) -> None:
        raise NotImplementedError

    def _group_step_of(self, group_id: int, params: Sequence[Tensor]) -> None:
        group = self.param_groups[group_id]
        selected = [p for p in params if _has_selection(p)]
        if self.offload:
            self.copy_mv_from_cpu(selected)
        self._update(selected, group)
        if self.offload:
            self.copy_mv_to_cpu(selected)
        for param in params:
            param.selected_grad = None  # type: ignore[attr-defined]

    @torch.no_grad()
    def _snapshot(self, params: Iterable[Tensor]) -> None:
        for param in params:
            if not _has_selection(param):
                continue
            swapped_in = self._swap_in(param)
            snapshot = self._snapshot_of(param)
            param.temp_selected_param = snapshot.cpu() if self.offload else snapshot  # type: ignore[attr-defined]
            self._swap_out(param, swapped_in, changed=False)


class ZenFlowSelectiveAdamW(_SelectiveAdamW):
    """Selective AdamW over whole parameters (ZeRO stages 1 and 2): column `j` of a 2-D weight is `data[:, j]`;
    a parameter of any other rank is taken whole.

    Args: torch.optim.AdamW's, plus `offload` (moments in host buffers, see the module doc) and `bucket_size`
    (elements updated at a time in offload mode).
    """

    def _read(self, param: Tensor) -> Tensor:
        if param.dim() != 2:
            return param.data.clone()
        return param.data[:, param.selected_indices.to(param.device)]  # type: ignore[attr-defined]

    def _write(self, param: Tensor, value: Tensor) -> None:
        if param.dim() != 2:
            param.data.copy_(value.reshape(param.shape))
        else:
            param.data[:, param.selected_indices.to(param.device)] = value.to(param.dtype)  # type: ignore[attr-defined]

    def temp_copy_param(self, group_to_paramlist: Mapping[int, Sequence[Tensor]]) -> None:
        """Snapshot the selected columns of the given parameters into `temp_selected_param`."""
        for params in group_to_paramlist.values():
            self._snapshot(params)

    @torch.no_grad()
    def group_step(self, group_to_paramlist: Mapping[int, Sequence[Tensor]]) -> None:
        """Update the given parameters, `{param group index: [params]}`."""
        for group_id, params in group_to_paramlist.items():
            self._group_step_of(group_id, params)

    def _bucket_step(self, group_id: int, bucket: list[Tensor]) -> None:
        self.group_step({group_id: bucket})


class ZenFlowSelectiveAdamW_stage3(_SelectiveAdamW):
    """Selective AdamW over ZeRO-3 partitions (`ds_tensor`, transposed: column `j` is row `j` of the partition).

    Parameters carry `ds_tensor`, `ds_shape` (`(columns, rows)` for a 2-D weight), `complete_column_offset`,
    `complete_numel` and `group_id`; `group_step` takes a list of parameters and groups them by `group_id`.
    """

    @staticmethod
    def _rows(param: Tensor) -> int:
        shape = param.ds_shape  # type: ignore[attr-defined]
        return 1 if len(shape) == 1 else int(shape[1])

    def _columns_view(self, param: Tensor) -> Tensor:
        rows = self._rows(param)
        part: Tensor = param.ds_tensor.data  # type: ignore[attr-defined]
        start, numel = int(param.complete_column_offset), int(param.complete_numel)  # type: ignore[attr-defined]
        return part.narrow(0, start, numel).view(numel // rows, rows)

    def _read(self, param: Tensor) -> Tensor:
        device = _compute_device(param)
        if self._rows(param) == 1:
            part: Tensor = param.ds_tensor.data  # type: ignore[attr-defined]
            return part.to(device, copy=True)
        cols = self._columns_view(param)
        return cols[param.selected_indices.to(cols.device)].to(device)  # type: ignore[attr-defined]

    def _write(self, param: Tensor, value: Tensor) -> None:
        part = param.ds_tensor.data  # type: ignore[attr-defined]
        if self._rows(param) == 1:
            part.copy_(value.reshape(part.shape))
            return
        cols = self._columns_view(param)
        cols[param.selected_indices.to(cols.device)] = value.to(cols.device, cols.dtype)  # type: ignore[attr-defined]

    def _swap_in(self, param: Tensor) -> bool:
        swapper = getattr(param, "nvme_swapper", None)
        if swapper is not None and param.ds_tensor.data.dim() == 0:  # type: ignore[attr-defined]
            swapper.swap_in([param], async_op=False)
            return True
        return False

    def _swap_out(self, param: Tensor, swapped_in: bool, *, changed: bool) -> None:
        if not swapped_in:
            return
        swapper = param.nvme_swapper  # type: ignore[attr-defined]
        if changed:
            swapper.swap_out_and_release([param])
        else:  # read only: drop the buffer without writing it back
            swapper.remove_partition_and_release_buffers([param])

    def temp_copy_param(self, paramlist: Iterable[Tensor]) -> None:
        """Snapshot the selected columns of the given parameters into `temp_selected_param`."""
        self._snapshot(paramlist)

    @torch.no_grad()
    def group_step(self, paramlist: Iterable[Tensor]) -> None:
        """Update the given parameters, grouped by their `group_id`."""
        by_group: dict[int, list[Tensor]] = {}
        for param in paramlist:
            by_group.setdefault(int(param.group_id), []).append(param)  # type: ignore[attr-defined]
        for group_id in sorted(by_group):
            self._group_step_of(group_id, by_group[group_id])

    def _bucket_step(self, group_id: int, bucket: list[Tensor]) -> None:
        for param in bucket:
            param.group_id = getattr(param, "group_id", group_id)  # type: ignore[attr-defined]
        self.group_step(bucket)


def _has_selection(param: Tensor) -> bool:
    return getattr(param, "selected_grad", None) is not None


def _compute_device(param: Tensor) -> torch.device:
    grad = getattr(param, "selected_grad", None)
    return grad.device if grad is not None else param.device

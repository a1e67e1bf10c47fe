"""ZenFlow (DeepSpeed's `zero_optimization.zenflow`): ZeRO stages 1 and 2 with the optimizer on the CPU, where
the columns of each weight that matter most are updated at every step and the rest every few steps.

[Note: ZenFlow step]
A ZenFlow step is one optimizer step of the engine (one accumulation window). With `W` warm-up rounds,
update interval `U` and selection interval `S` (0: select once), step `m` (counted from 0) does:
- `m < W`: an ordinary step (CPU Adam over the whole shard).
- `m == W`, or `m % S == 0` past the warm-up: *select*. The masters take the parameters' values (they missed
  the selective updates), the selective optimizer's moments are zeroed (its step counts go on), and each 2-D
  weight keeps the `int(topk_ratio * columns)` columns with the largest sum of |gradient| over their rows
  (column `j` of a weight `(rows, columns)` is `weight[:, j]`, the input feature `j` of a Linear). The
  column sums are one all-reduce of a vector of all 2-D weights' column counts, so every rank selects alike.
- every step past the warm-up: the gradient of the selected columns (and of every parameter that is not
  2-D, which the selective optimizer owns whole) is assembled on every rank (one all-reduce of those
  elements) and `ZenFlowSelectiveAdamW` updates them in the replicated parameters; the whole shard's
  gradient is added to the CPU accumulator.
- at an *update boundary* (`(m + 1 - W) % U == 0`, or `(m + 1) % S == 0` so that a selection never strands
  gradients): CPU Adam updates the whole shard from the accumulated gradient (clipped by its own norm),
  the shards are gathered into the parameters, and the selected columns take back the selective values
  (`temp_copy_param` before, restored by the selective step after): they are the selective optimizer's.
With `overlap_step` the CPU update of a window runs in a thread during the next window and reaches the
parameters at the next update boundary (one window late, as in DeepSpeed); a selection (which needs every
update in the parameters) and a checkpoint wait for it first (its gradients have an accumulator of their own,
and it steps a copy of the optimizer's param groups, so the LR schedule cannot race it).
As in DeepSpeed: every gradient is divided by `U` (DeepSpeed runs the window as gradient accumulation), the
CPU update's bias correction counts ZenFlow steps (`m + 1`), not CPU updates, and only the CPU update is
clipped. Checkpoints hold the CPU optimizer's state; the selective moments, the selection and the gradients
of an unfinished window are not saved (a resumed run selects again at its first step).
"""

from __future__ import annotations

import math
import threading
from typing import Any

import torch

from slipstream.accelerator import get_accelerator
from slipstream.comm import collectives
from slipstream.config.plan import ZenFlowPlan
from slipstream.ops.adam.zenflow_torch_adam import ZenFlowSelectiveAdamW
from slipstream.zero.flat_group import FlatGroup
from slipstream.zero.optimizer import StepResult, ZeroOptimizer

__all__ = ["ZenFlowMixin", "zenflow_stage"]

_HYPER = ("lr", "betas", "eps", "weight_decay")


class _Column2D:
    """A 2-D weight's selection: where its column scores sit and which columns are chosen."""

    def __init__(self, param: torch.Tensor, score_offset: int, k: int) -> None:
        self.param = param
        self.rows, self.cols = int(param.shape[0]), int(param.shape[1])
        self.score_offset = score_offset
        self.k = k
        self.indices = torch.zeros(0, dtype=torch.long)
        self.position = torch.full((self.cols,), -1, dtype=torch.long)
        """column -> its place among the selected ones, -1 when not selected."""


class ZenFlowMixin:
    """Mixed in before `Stage1Optimizer` / `Stage2Optimizer` (see `zenflow_stage`): replaces the step."""

    groups: list[FlatGroup]
    optimizer: torch.optim.Optimizer

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        me: Any = self
        zenflow: ZenFlowPlan = me.zero.zenflow
        if zenflow.update_interval is None:
            raise NotImplementedError(
                'zero_optimization.zenflow.update_interval: "auto" (an adaptive interval) is not implemented yet; '
                "give the number of steps between CPU updates, e.g. 4"
            )
        if me._other_groups() or me.model_parallel is not None:
            raise NotImplementedError(
                "zero_optimization.zenflow with MoE experts or tensor parallelism is not implemented; remove the "
                "zenflow section or train without them"
            )
        self.zenflow = zenflow
        self.zf_step = 0
        """ZenFlow steps taken (DeepSpeed's micro_step + 1)."""
        self._select_every = 0 if zenflow.select_per_epoch else zenflow.select_every
        self._columns: dict[int, _Column2D] = {}
        offset = 0
        for flat in self.groups:
            for param in flat.params:
                if param.dim() == 2:
                    k = int(zenflow.topk_ratio * param.shape[1])
                    self._columns[id(param)] = _Column2D(param, offset, k)
                    offset += int(param.shape[1])
        self._score_numel = offset
        self.selective = ZenFlowSelectiveAdamW(
            [
                {"params": flat.params, **{key: hyper[key] for key in _HYPER if key in hyper}}
                for flat, hyper in zip(self.groups, self.optimizer.param_groups)
            ],
            offload=zenflow.offload,
        )
        slots = 2 if zenflow.overlap_step else 1  # overlap: one accumulates while the other is being applied
        self._accumulated = [
            [[torch.zeros_like(piece) for piece in flat.master_pieces] for flat in self.groups] for _ in range(slots)
        ]
        self._slot = 0
        self._background: _Background | None = None
        self._unpublished = False
        """overlap_step: the masters hold an update the parameters have not received yet."""

    def set_steps_per_epoch(self, steps: int) -> None:
        """The engine's ZenFlow steps per epoch (its loader's batches / accumulation), for the "epoch" and
        "auto" selection strategies; without a loader they select once, as in DeepSpeed."""
        if self.zenflow.select_per_epoch:
            self._select_every = self.zenflow.select_every * max(int(steps), 0)
            interval = self.zenflow.update_interval or 1
            if 0 < self._select_every < interval:
                raise ValueError(
                    f"zero_optimization.zenflow: selecting every {self._select_every} steps (select_interval "
                    f"{self.zenflow.select_every} epoch(s) of {steps} steps) is more frequent than update_interval "
                    f"{interval}; raise select_interval or lower update_interval"
                )

    # ---- the step ([Note: ZenFlow step]) ----
    def step(self, *, grad_divisor: float, clip: float) -> StepResult:
        me: Any = self
        interval = int(self.zenflow.update_interval or 1)
        result: StepResult = me._settle_and_measure(grad_divisor * interval)
        if result.overflow:
            return result
        result = StepResult(grad_norm=result.grad_norm * interval, overflow=False)  # the step's own gradient
        m, warm_up, every = self.zf_step, self.zenflow.full_warm_up_rounds, self._select_every
        self._sync_hyperparameters()
        if m < warm_up:
            self._full_update(self._host_grads(), clip)
        else:
            if m == warm_up or (every and m % every == 0):
                self._select(first=m == 0)
            self._hand_over_selected_grads()
            window = self._accumulated[self._slot]
            for sums, grads in zip(window, self._host_grads()):
                for total, grad in zip(sums, grads):
                    total.add_(grad)
            if (m + 1 - warm_up) % interval == 0 or (every and (m + 1) % every == 0):
                self.selective.temp_copy_param({i: flat.params for i, flat in enumerate(self.groups)})
                if self.zenflow.overlap_step:  # the last window's update reaches the parameters; this one starts
                    self._publish_pending()
                    self._prepare_update(window, clip)
                    self._background = _Background(self, window)
                    self._slot ^= 1
                else:
                    self._full_update(window, clip)
                    _zero(window)
            self.selective.step()
        me.zero_grad()
        self.zf_step += 1
        return result

    def _host_grads(self) -> list[list[torch.Tensor]]:
        """This step's owned gradients where the masters live (host copies), the copies complete."""
        grads = [flat.grads_for_optimizer() for flat in self.groups]
        get_accelerator().synchronize()  # device -> host copies are non-blocking
        return grads

    def _sync_hyperparameters(self) -> None:
        """The selective optimizer follows the CPU optimizer's hyperparameters (the LR schedule)."""
        for mine, theirs in zip(self.selective.param_groups, self.optimizer.param_groups):
            for key in _HYPER:
                if key in theirs:
                    mine[key] = theirs[key]

    def _full_update(self, grads: list[list[torch.Tensor]], clip: float) -> None:
        """CPU Adam over the whole shard with `grads`, clipped by their global norm; shards gathered after."""
        me: Any = self
        self._prepare_update(grads, clip)
        me._update_from(grads)

    def _prepare_update(self, grads: list[list[torch.Tensor]], clip: float) -> None:
        """Clip `grads` by their global norm (one all-reduce) and set the CPU optimizer's step counts."""
        me: Any = self
        if clip > 0:
            sum_sq = torch.zeros(1, dtype=torch.float64, device=self.groups[0].device)
            for group_grads in grads:
                for grad in group_grads:
                    sum_sq += float(torch.linalg.vector_norm(grad, dtype=torch.float32).double() ** 2)
            if me.world_size > 1:
                collectives.all_reduce(sum_sq, group=me.process_group)
            norm = math.sqrt(float(sum_sq))
            if math.isfinite(norm) and norm > clip:
                for group_grads in grads:
                    for grad in group_grads:
                        grad.mul_(clip / (norm + 1e-6))
        self._set_step_counts(self.zf_step + 1)

    # ---- overlap_step: the CPU update in a background thread ([Note: ZenFlow step]) ----
    def _wait(self) -> None:
        """Wait for a background update (its gradients' slot is then free); raise what it raised."""
        if self._background is None:
            return
        background, self._background = self._background, None
        background.join()
        _zero(background.grads)
        self._unpublished = True

    def _publish_pending(self) -> None:
        """The finished background update into the parameters (all of their columns; callers restore the
        selected ones)."""
        me: Any = self
        self._wait()
        if self._unpublished:
            me._publish_params(from_low_precision=bool(me._low_precision_out))
            self._unpublished = False

    def _publish_keeping_selected(self) -> None:
        """`_publish_pending` with the selected columns (and the parameters the selective optimizer owns whole)
        kept as they are: before a new selection the parameters must hold every update."""
        kept = []
        for flat in self.groups:
            for param in flat.params:
                column = self._columns.get(id(param))
                if column is not None and column.k == 0:
                    continue
                where: Any = slice(None) if column is None else (slice(None), column.indices.to(param.device))
                kept.append((param, where, param.data[where].clone()))
        self._publish_pending()
        for param, where, value in kept:
            param.data[where] = value

    def resident_state(self) -> Any:
        """Checkpoints read the masters and states: a background update finishes first (and is published at the
        next update boundary, as it would have been)."""
        self._wait()
        return super().resident_state()  # type: ignore[misc]

    def state_dict(self) -> dict:
        self._wait()
        return super().state_dict()  # type: ignore[misc]

    def _set_step_counts(self, count: int) -> None:
        """DeepSpeed's CPU update is told the ZenFlow step (`step_id`), which its bias correction uses."""
        for flat in self.groups:
            for piece in flat.master_pieces:
                state = self.optimizer.state[piece]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(piece, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(piece, dtype=torch.float32)
                if isinstance(state.get("step"), torch.Tensor):
                    state["step"].fill_(count - 1)  # the optimizer adds one
                elif "step" in state:
                    state["step"] = count - 1

    # ---- selection and the selected gradients ----
    def _owned_slices(self, flat: FlatGroup) -> list[tuple[torch.Tensor, int, int, torch.Tensor]]:
        """(parameter, first, end element of it this rank owns, that part of the owned gradient)."""
        me: Any = self
        out: list[tuple[torch.Tensor, int, int, torch.Tensor]] = []
        for b, index, a, z in me.owned_ranges(flat):
            start, offset = flat.piece_ranges[b][0], flat.layout.slots[index].flat_offset
            out.append((flat.params[index], a - offset, z - offset, flat.owned_grads[b][a - start : z - start]))
        return out

    @torch.no_grad()
    def _select(self, *, first: bool) -> None:
        me: Any = self
        if self.zenflow.overlap_step:
            self._publish_keeping_selected()
        if not first:  # the masters missed every selective update: take the parameters' values
            for flat in self.groups:
                for piece, (start, end) in zip(flat.master_pieces, flat.piece_ranges):
                    piece.copy_(flat.flat_params[start:end])
        self.selective.clear_selected_mv()
        if not self._columns:
            return
        device = self.groups[0].device
        scores = torch.zeros(self._score_numel, dtype=torch.float32, device=device)
        for flat in self.groups:
            for param, lo, hi, grad in self._owned_slices(flat):
                column = self._columns.get(id(param))
                if column is None:
                    continue
                own = scores[column.score_offset : column.score_offset + column.cols]
                for row, start, part in _rows_of(lo, hi, column.cols, grad):
                    if row is None:  # a block of whole rows
                        own.add_(part.abs().sum(0, dtype=torch.float32))
                    else:  # part of one row, from column `start`
                        own[start : start + part.numel()] += part.abs().to(torch.float32)
        if me.world_size > 1:
            collectives.all_reduce(scores, group=me.process_group)
        for column in self._columns.values():
            own = scores[column.score_offset : column.score_offset + column.cols]
            chosen = torch.topk(own, column.k).indices.sort().values if column.k else own.new_zeros(0, dtype=torch.long)
            column.indices = chosen.to(torch.long)
            column.position = torch.full((column.cols,), -1, dtype=torch.long, device=device)
            column.position[column.indices] = torch.arange(column.k, device=device)
            column.param.selected_indices = column.indices.to(column.param.device)  # type: ignore[attr-defined]

    @torch.no_grad()
    def _hand_over_selected_grads(self) -> None:
        """Every rank gets the whole gradient of the selected columns and of the non-2-D parameters."""
        me: Any = self
        device = self.groups[0].device
        shapes: dict[int, tuple[int, ...]] = {}
        offsets: dict[int, int] = {}
        total = 0
        for flat in self.groups:
            for param in flat.params:
                column = self._columns.get(id(param))
                if column is not None and column.k == 0:
                    continue
                shape = (column.rows, column.k) if column is not None else tuple(param.shape)
                shapes[id(param)], offsets[id(param)] = shape, total
                total += math.prod(shape)
        buffer = torch.zeros(total, dtype=self.groups[0].grad_storage.dtype, device=device)
        for flat in self.groups:
            for owner, lo, hi, grad in self._owned_slices(flat):
                if id(owner) not in offsets:
                    continue
                base = offsets[id(owner)]
                column = self._columns.get(id(owner))
                if column is None:
                    buffer[base + lo : base + hi].copy_(grad)
                    continue
                selected = buffer[base : base + column.rows * column.k].view(column.rows, column.k)
                indices = column.indices
                for row, start, part in _rows_of(lo, hi, column.cols, grad):
                    if row is None:  # whole rows [start, start + len(part)) of the weight
                        selected[start : start + part.shape[0]] = part[:, indices]
                        continue
                    inside = indices[(indices >= start) & (indices < start + part.numel())]
                    selected[row, column.position[inside]] = part[inside - start]
        if me.world_size > 1 and total:
            collectives.all_reduce(buffer, group=me.process_group)
        for flat in self.groups:
            for param in flat.params:
                if id(param) not in offsets:
                    continue
                base, shape = offsets[id(param)], shapes[id(param)]
                grad = buffer[base : base + math.prod(shape)].view(shape)
                param.selected_grad = grad.to(param.device)  # type: ignore[attr-defined]
                if self.zenflow.offload and not hasattr(param, "exp_avg_cpu_data"):
                    param.exp_avg_cpu_data = torch.zeros(grad.numel(), dtype=param.dtype)  # type: ignore[attr-defined]
                    param.exp_avg_sq_cpu_data = torch.zeros(grad.numel(), dtype=param.dtype)  # type: ignore[attr-defined]


def _rows_of(lo: int, hi: int, cols: int, grad: torch.Tensor) -> list[tuple[int | None, int, torch.Tensor]]:
    """Elements [lo, hi) of a row-major `(rows, cols)` weight (`grad` holds them) as pieces: (row, first column,
    the 1-D part of that row) for part of a row, (None, first row, a 2-D block) for whole rows."""
    pieces: list[tuple[int | None, int, torch.Tensor]] = []
    at = lo
    while at < hi:
        row, col = divmod(at, cols)
        if col == 0 and hi - at >= cols:  # whole rows
            count = (hi - at) // cols
            pieces.append((None, row, grad[at - lo : at - lo + count * cols].view(count, cols)))
            at += count * cols
        else:
            end = min(hi, (row + 1) * cols)
            pieces.append((row, col, grad[at - lo : end - lo]))
            at = end
    return pieces


class _Background:
    """One CPU update running in a thread: a view of the optimizer with its own param-group dicts, so the LR
    scheduler of the next steps cannot change the hyperparameters of an update under way."""

    def __init__(self, owner: Any, grads: list[list[torch.Tensor]]) -> None:
        self.grads = grads
        self.error: BaseException | None = None
        optimizer = owner.optimizer
        view = object.__new__(type(optimizer))  # every attribute shared (state, op), but the group dicts
        view.__dict__.update(optimizer.__dict__)
        view.param_groups = [dict(group) for group in optimizer.param_groups]
        for flat, group_grads in zip(owner.groups, grads):
            for piece, grad in zip(flat.master_pieces, group_grads):
                piece.grad = grad
        low_precision = owner._low_precision_out

        def run() -> None:
            try:
                if low_precision:
                    view.step(low_precision_out=low_precision)
                else:
                    view.step()
            except BaseException as error:  # re-raised in the training thread by join()
                self.error = error

        self.thread = threading.Thread(target=run, name="zenflow-cpu-update", daemon=True)
        self.thread.start()

    def join(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise RuntimeError(f"ZenFlow's background CPU update failed: {self.error}") from self.error


def _zero(grads: list[list[torch.Tensor]]) -> None:
    for group_grads in grads:
        for grad in group_grads:
            grad.zero_()


def zenflow_stage(stage: type[ZeroOptimizer]) -> type[ZeroOptimizer]:
    """The ZenFlow optimizer of a stage (1 or 2): the stage class with `ZenFlowMixin` before it."""
    return type(f"ZenFlow{stage.__name__}", (ZenFlowMixin, stage), {})

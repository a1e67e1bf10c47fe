"""`Stage3Optimizer`: the ZeRO step (zero/optimizer.py, phases 2-3) on the shards of ZeRO-3 units.

The wrapped torch optimizer sees, per param group, one master piece per *run* (zero/stage3/group.py):
consecutive trainable parameters of one unit in the same param group (contiguous in the unit's shard). When
the master dtype is the model dtype and nothing is offloaded, the pieces are views of the shards (updated in place);
otherwise they live in one fp32 buffer per group (on the host with optimizer offload) and are copied into
the shards after the step. Gradients reach the per-group gradient shards through the coordinator, which
hands each complete unit to `unit_ready` and the rest to `flush` at the end of backward (see [Note:
ZeRO-3 schedule]); this class packs and reduce-scatters them, strictly in the coordinator's fixed order.
Frozen parameters get no master piece, no optimizer state and no place in the reduce-scatter.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from slipstream.comm import collectives
from slipstream.zero.optimizer import ZeroOptimizer
from slipstream.zero.slices import OwnedSlice
from slipstream.zero.stage3.group import Run, Stage3Group, cut_runs, in_memory
from slipstream.zero.stage3.model import ZeroModel
from slipstream.zero.stage3.sharded_param import ShardedParameter, ZeroParamStatus
from slipstream.zero.stage3.unit import Unit
from slipstream.zero.staging import StagingRing


class Stage3Optimizer(ZeroOptimizer):
    """ZeRO-3: parameters, gradients and optimizer state sharded; `model` is the engine's ZeroModel."""

    owns_all = False
    full_grad_storage = False

    def __init__(self, optimizer: torch.optim.Optimizer, *, model: ZeroModel, **kwargs: Any) -> None:
        self.model = model
        if model.sharding.replicas is not None:  # MiCS: the step's group is the shard group ([Note: MiCS ...])
            kwargs["group"] = model.sharding.shard
        super().__init__(optimizer, **kwargs)

    def _build_groups(self, *, bucket_numel: int, master_dtype: torch.dtype, grad_dtype: torch.dtype) -> list[Any]:
        group_of = self._group_of_trainable()
        sub_group_numel = self.model.plan.sub_group_numel
        runs: dict[int, list[Run]] = {n: [] for n in range(len(self.optimizer.param_groups))}
        self._trainable: dict[int, list[int]] = {}
        self._receive_offsets: dict[int, list[int]] = {}
        self._receive_numel: dict[int, int] = {}
        for unit in self.model.units:
            cut = cut_runs(unit, group_of, sub_group_numel)
            self._trainable[unit.uid], self._receive_offsets[unit.uid] = cut.indices, cut.receive_offsets
            self._receive_numel[unit.uid] = cut.receive_numel
            for run in cut.runs:
                runs[group_of[id(unit.params[run.indices[0]])]].append(run)
        self._group_numbers = [n for n in sorted(runs) if runs[n]]
        groups = [
            Stage3Group(
                runs[n],
                device=self.model.device,
                master_dtype=master_dtype,
                grad_dtype=grad_dtype,
                offload=self.offload,
                sub_group_numel=sub_group_numel,
            )
            for n in self._group_numbers
        ]
        self._targets: dict[int, list[tuple[int, int, torch.Tensor]]] = {u.uid: [] for u in self.model.units}
        for group in groups:
            for run, grad in zip(group.runs, group.owned_grads):
                self._targets[run.unit.uid].append((run.receive_start, run.receive_start + run.numel, grad))
        self._grad_swap: Any = None
        if any(group.grad_buffers for group in groups):
            self._build_grad_swap(groups)
        self._order = self._reduce_order()
        self._units = {u.uid: u for u in self.model.units}
        largest = max(self._receive_numel.values(), default=0)
        self._ring = StagingRing.for_plan(
            self.zero, staging_numel=largest * self.world_size, receive_numel=largest, device=self.model.device
        )
        self.model.use_comm_stream(self._ring.comm)  # one stream per engine: the gathers share the ring's
        self._ready: dict[int, dict[int, torch.Tensor]] = {}
        self._next = 0
        self.model.coordinator.watch_gradients(self, {uid: frozenset(ix) for uid, ix in self._trainable.items()})
        return groups

    def _group_of_trainable(self) -> dict[int, int]:
        """id(parameter) -> its param group's number, for the trainable ones; a parameter not of the engine's
        model is an error."""
        group_of: dict[int, int] = {}
        for number, hyper in enumerate(self.optimizer.param_groups):
            for param in hyper["params"]:
                if not isinstance(param, ShardedParameter) or param.ds_record.unit.manager is not self.model:
                    raise ValueError(
                        "ZeRO-3: the optimizer holds a parameter that is not part of the engine's model "
                        f"({type(param).__name__} of shape {tuple(param.shape)}); build the optimizer "
                        "from model.parameters()"
                    )
                if param.requires_grad:
                    group_of[id(param)] = number
        return group_of

    def _reduce_order(self) -> list[int]:
        """The uids of the units with trainable parameters in the order their gradients are reduced: reverse
        registration order (roughly backward's), then the root and persistent units. Those complete only at the
        end of backward, and a unit waiting for them would hold its full-size gradients until then."""
        last = [u for u in self.model.units if u.persistent or u.name == "<root>"]
        return [
            u.uid for u in [*reversed([u for u in self.model.units if u not in last]), *last] if self._trainable[u.uid]
        ]

    def _build_grad_swap(self, groups: list[Stage3Group]) -> None:
        """Swapped gradients ([Note: swapped gradients]): the sub-groups' buffers go to the policy's files; each
        unit's delivery is cut by sub-group, and a sub-group whose units have all delivered in a backward is
        measured (the fp32 norm of each run's gradient, which phase 2 reads instead of the gradients)."""
        buffers: list[tuple[torch.Tensor, str]] = []
        self._sub_runs, self._run_span = [], []
        sub_of: dict[tuple[int, int], int] = {}  # (group, run) -> sub-group
        run_base = 0
        for number, group in enumerate(groups):
            for (start, end), buffer in zip(group.sub_groups, group.grad_buffers):
                for r in range(start, end):
                    sub_of[(number, r)] = len(buffers)
                self._run_span.append((run_base + start, run_base + end))
                self._sub_runs.append([group.owned_grads[r] for r in range(start, end)])
                buffers.append((buffer, f"group{number}_grad"))
            run_base += len(group.runs)
        self._grad_swap = self.offload.swap_gradients(buffers)
        self._run_norms = torch.zeros(run_base, dtype=torch.float32)
        """fp32 norm of every run's (undivided) gradient, in the order of the groups' owned_grads."""
        self._grad_scale: tuple[float, float] = (1.0, 1.0)  # (1 / divisor, clip coefficient) for the step
        self._swapped_targets: dict[int, list[tuple[int, list[tuple[int, int, torch.Tensor]]]]] = {}
        units_of: list[set[int]] = [set() for _ in buffers]
        for number, group in enumerate(groups):
            for r, (run, grad) in enumerate(zip(group.runs, group.owned_grads)):
                sub = sub_of[(number, r)]
                units_of[sub].add(run.unit.uid)
                entries = self._swapped_targets.setdefault(run.unit.uid, [])
                if not entries or entries[-1][0] != sub:
                    entries.append((sub, []))
                entries[-1][1].append((run.receive_start, run.receive_start + run.numel, grad))
        self._units_per_sub = [len(u) for u in units_of]
        self._units_left = list(self._units_per_sub)

    def _measure_sub_group(self, sub: int) -> None:
        a, b = self._run_span[sub]
        norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in self._sub_runs[sub]]
        if norms:
            self._run_norms[a:b] = torch.stack(norms)

    def _sub_group_delivered(self, sub: int) -> None:
        self._units_left[sub] -= 1
        if self._units_left[sub] == 0:  # complete for this backward: measured (written out when room is needed)
            self._units_left[sub] = self._units_per_sub[sub]
            self._measure_sub_group(sub)

    def _repoint_optimizer(self) -> None:
        hypers = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        self.optimizer.param_groups = []
        self.optimizer.state.clear()
        for number, group in zip(self._group_numbers, self.groups):
            self.optimizer.add_param_group({**hypers[number], "params": group.master_pieces})

    # ---- gradients (called by the coordinator) ----
    def unit_ready(self, unit: Unit, grads: dict[int, torch.Tensor]) -> None:
        self._ready[unit.uid] = grads
        while self._next < len(self._order) and self._order[self._next] in self._ready:
            uid = self._order[self._next]
            self._launch(uid, self._ready.pop(uid))

    def flush(self, grads_by_uid: dict[int, dict[int, torch.Tensor]]) -> None:
        self._settled = False  # the end of a backward: new gradients were added
        while self._next < len(self._order):
            uid = self._order[self._next]
            ready = self._ready.pop(uid, None)
            self._launch(uid, ready if ready is not None else grads_by_uid.get(uid, {}))
        self._ring.finish_all()
        self._next = 0
        self._ready.clear()
        if self._grad_swap is not None:
            self._settle_counts()

    def _settle_counts(self) -> None:
        """Every unit delivered once since the last backward, so every sub-group's count is full again; one that
        is not went through a backward that stopped part-way (an exception): measure it now, with its whole sum."""
        for sub, left in enumerate(self._units_left):
            if left != self._units_per_sub[sub]:
                self._units_left[sub] = self._units_per_sub[sub]
                with self._one_sub_group(sub):
                    self._measure_sub_group(sub)

    def _launch(self, uid: int, grads: dict[int, torch.Tensor]) -> None:
        width = self._receive_numel[uid]
        slot, staging, receive = self._ring.take(width * self._units[uid].world_size, width)
        with self._ring.launching(keep=grads.values()):  # packed and launched on the communication stream
            work = self._units[uid].reduce_gradients(  # see [Note: gradients divided on arrival]
                grads, self._trainable[uid], staging, receive, self._receive_offsets[uid], scale=1.0 / self.pre_divided
            )
        grads.clear()  # the full-size gradients are packed: drop them now, not at the end of backward
        deliver = self._swapped_delivery(uid) if self._grad_swap is not None else self._delivery(uid)
        if self.model.sharding.replicas is not None:
            deliver = _summed_across(self.model.sharding.replicas, deliver)
        self._ring.launched(slot, work, receive, deliver)
        self._next += 1

    def _delivery(self, uid: int) -> Any:
        targets = self._targets[uid]

        def deliver(received: torch.Tensor) -> None:
            for start, end, grad in targets:
                grad.add_(received[start:end])

        return deliver

    def _swapped_delivery(self, uid: int) -> Any:
        """The same additions, one sub-group at a time: its buffer is opened (read back or zeroed) first."""
        by_sub = self._swapped_targets.get(uid, [])

        def deliver(received: torch.Tensor) -> None:
            for sub, entries in by_sub:
                self._grad_swap.open(sub)
                for start, end, grad in entries:
                    grad.add_(received[start:end])
                self._sub_group_delivered(sub)

        return deliver

    def micro_step_done(self, *, reduce: bool) -> None:
        if not reduce:
            raise RuntimeError(
                "ZeRO stage 3 reduces gradients at the end of every backward; no_sync() is not "
                "available (rely on gradient_accumulation_steps)"
            )
        self.model.check_deferred_tags()

    def _reduce_for_step(self) -> None:
        self._ring.finish_all()

    # ---- swapped gradients: phase 2 from the measured norms, the scaling applied per sub-group ----
    def _grad_stats(self, grad_divisor: float) -> torch.Tensor:
        if self._grad_swap is None:
            return super()._grad_stats(grad_divisor)
        inv = 1.0 / grad_divisor
        self._grad_scale = (inv, 1.0)
        # fp32 norm(g) * inv equals the resident path's fp32 norm(g * inv) exactly when the divisor is a power of
        # two (ranks x micro-batches x loss scale usually is), else to the last bit or so
        norms = (self._run_norms * inv).double()
        stats = torch.stack([norms.pow(2).sum(), (~torch.isfinite(norms)).sum().double()])
        if self.model_parallel is not None:
            stats[0] -= self._swapped_replicated_sum_sq(self.model_parallel, inv)
        if self.world_size > 1:
            collectives.all_reduce(stats, group=self.process_group)
        if self.model_parallel is not None:
            collectives.all_reduce(stats, group=self.model_parallel[0])
        return stats

    def _swapped_replicated_sum_sq(self, model_parallel: tuple[Any, set[int]], inv: float) -> float:
        """`_replicated_sum_sq` over swapped gradients: the sub-groups holding TP-replicated parameters are read in
        one at a time (in grad_parts order, each norm times `inv` as phase 2 would have divided)."""
        group, replicated = model_parallel
        share = 1.0 - 1.0 / dist.get_world_size(group)
        total = 0.0
        for sub, (number, start, end) in enumerate(self.sub_groups):
            runs = self.groups[number].runs[start:end]
            if not any(id(run.unit.params[i]) in replicated for run in runs for i in run.indices):
                continue
            with self._one_sub_group(sub):  # views of the buffer exist only while it is in memory
                for param, grad in self._parts(self.groups[number], start, end):
                    if id(param) in replicated:
                        norm = torch.linalg.vector_norm(grad, dtype=torch.float32) * inv
                        total += float(norm.double() ** 2)
        return share * total

    def _clip_grads(self, coef: float) -> None:
        if self._grad_swap is None:
            super()._clip_grads(coef)
        else:
            self._grad_scale = (self._grad_scale[0], coef)

    def step_sub_group(self, index: int) -> None:
        if self._grad_swap is not None:  # read in by the policy with the masters: divide, clip, as phase 2 would
            buffer = self._grad_swap.fetch(index)
            inv, coef = self._grad_scale
            buffer.mul_(inv)
            if coef != 1.0:
                buffer.mul_(coef)
        super().step_sub_group(index)

    def zero_grad(self) -> None:
        super().zero_grad()
        if self._grad_swap is not None:
            self._grad_swap.zero_all()
            self._run_norms.zero_()
            self._grad_scale = (1.0, 1.0)

    def _sub_groups_of(self, only: str | None) -> list[int]:
        return [
            sub
            for sub, (number, start, end) in enumerate(self.sub_groups)
            if only is None
            or any(
                self.param_names.get(id(run.unit.params[i]), run.unit.records[i].name) == only
                for run in self.groups[number].runs[start:end]
                for i in run.indices
            )
        ]

    @contextlib.contextmanager
    def gradients_resident(self, only: str | None = None, *, changed: bool = False) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if self._grad_swap is not None:
                for sub in self._sub_groups_of(only):
                    stack.enter_context(self._one_sub_group(sub, changed=changed))
            yield

    def _publish_params(self, *, from_low_precision: bool, copied: bool = False) -> None:
        self.model.shards_changed()
        for group in self.groups:
            if not copied:
                group.copy_master_to_params(from_low_precision=from_low_precision)
        for unit in self.model.units:  # gathered values are stale now: gather them again (persistent ones)
            if unit.status is ZeroParamStatus.AVAILABLE:
                unit.status = ZeroParamStatus.NOT_AVAILABLE
                unit.start_gather()
                unit.finish_gather()

    def trainable_params(self) -> list[torch.Tensor]:
        return [self._units[uid].params[i] for uid, indices in self._trainable.items() for i in indices]

    def owned_slices(self, names: dict[int, str], *, for_save: bool, only: str | None = None) -> list[OwnedSlice]:
        """This rank's slice of every trainable parameter (or of the one named `only`): [rank *
        ceil(numel/world), ...) clipped to numel."""
        out: list[OwnedSlice] = []
        for number, group in enumerate(self.groups):
            for run, master, grad in zip(group.runs, group.master_pieces, group.owned_grads):
                offset = 0
                for index in run.indices:
                    record = run.unit.records[index]
                    name = names.get(id(run.unit.params[index]), record.name)
                    part = record.owned_values(name) if only is None or name == only else None
                    if part is not None:
                        end = offset + part.numel
                        out.append(
                            dataclasses.replace(
                                part,
                                master=master[offset:end] if in_memory(master) else None,
                                piece=master,
                                piece_offset=offset,
                                group_index=number,
                                grad=grad[offset:end] if in_memory(grad) else None,
                            )
                        )
                    offset += record.shard_numel
        return out

    def grad_parts(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self._grad_swap is not None:
            raise NotImplementedError(
                "grad_parts: with ZeRO-3 and offload_optimizer.device 'nvme' the gradients live in files, one "
                "sub-group at a time, and views of them are valid only while it is in memory; read them inside "
                "optimizer.gradients_resident(), or use offload_optimizer.device 'cpu'"
            )
        return [part for group in self.groups for part in self._parts(group, 0, len(group.runs))]

    @staticmethod
    def _parts(group: Stage3Group, start: int, end: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, its owned gradient) for the runs [start, end) of `group`."""
        out: list[tuple[torch.Tensor, torch.Tensor]] = []
        for run, grad in zip(group.runs[start:end], group.owned_grads[start:end]):
            offset = 0
            for index in run.indices:
                piece = run.unit.layout.shard_numels[index]
                out.append((run.unit.params[index], grad[offset : offset + piece]))
                offset += piece
        return out

    def first_nonfinite_param(self, names: dict[int, str]) -> str | None:
        for sub, (number, start, end) in enumerate(self.sub_groups):
            # swapped gradients: one sub-group in memory at a time (the check is on the undivided sums)
            with self._one_sub_group(sub):
                for param, grad in self._parts(self.groups[number], start, end):
                    if not bool(torch.isfinite(grad).all()):
                        return param.ds_record.name  # type: ignore[attr-defined]
        return None

    @contextlib.contextmanager
    def _one_sub_group(self, sub: int, *, changed: bool = False) -> Iterator[None]:
        """Sub-group `sub`'s gradients in memory for the block (`changed`: the block writes them, so their norms are
        measured again and the buffer is written back when it leaves memory)."""
        if self._grad_swap is None:
            yield
            return
        self._grad_swap.fetch(sub)
        try:
            yield
        finally:
            if changed:
                self._measure_sub_group(sub)
            self._grad_swap.release(sub, changed=changed)

    def owned_bytes(self) -> dict[str, int]:
        total = super().owned_bytes()
        model = self.model.owned_bytes()
        total["params"] += model["params"]
        total["comm_buffers"] += model["comm_buffers"]
        total["offloaded_params"] = model["offloaded_params"]
        return total

    def _comm_buffer_bytes(self) -> int:
        return self._ring.nbytes

    @property
    def parameter_offload(self) -> Any:
        """DeepSpeed's `optimizer.parameter_offload`, as TRL's generation context uses it (parameter_offload.py)."""
        from slipstream.zero.stage3.parameter_offload import ParameterOffloadView

        return ParameterOffloadView(self.model.module)

    def remove_hooks(self) -> None:
        super().remove_hooks()
        self.model.detach_hooks()


def _summed_across(replicas: dist.ProcessGroup, deliver: Any) -> Any:
    """MiCS: a unit's reduce-scattered gradients, summed inside the shard group, are all-reduced across the shard
    groups before `deliver` adds them in (see [Note: MiCS shard groups])."""

    def summed(received: torch.Tensor) -> None:
        collectives.all_reduce(received, group=replicas)
        deliver(received)

    return summed

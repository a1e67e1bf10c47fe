"""`ZeroOptimizer`: the step shared by ZeRO stages 0, 1 and 2; each stage says how gradients are reduced.

The communication schedule of one optimizer step (the engine calls `step()` at the accumulation boundary):
    Phase 1: finish the gradient reduction (stage 0: all-reduce each bucket; stage 1: reduce-scatter each
             bucket; stage 2: flush the buckets still pending from backward) -- `_reduce_for_step()`.
    Phase 2: scale the owned gradients once by 1 / (world * accumulation steps * loss scale); check for
             inf/nan (one all-reduce of a flag, fp16 and bf16); compute the global norm (one all-reduce
             of a scalar when sharded); clip.
    Phase 3: the wrapped torch optimizer updates the master pieces; Phase 4: cast them into the flat params and
             gather every rank's (stages 1, 2, span by span with phase 3: [Note: overlapped gather ...]).
Gradients reach the flat grad storage through post-accumulate-grad hooks, so `loss.backward()` and
`engine.backward(loss)` are the same thing here.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from slipstream.accelerator import get_accelerator
from slipstream.comm import collectives
from slipstream.config.plan import PrecisionPlan, ZeroPlan
from slipstream.offload.policy import OffloadPolicy
from slipstream.precision.masters import master_rounding
from slipstream.precision.reduce_dtypes import reduce_dtype_of
from slipstream.zero.flat_group import FlatGroup
from slipstream.zero.layout import build_layout
from slipstream.zero.slices import OwnedSlice
from slipstream.zero.span_step import SpanStep
from slipstream.zero.sub_group_step import SubGroupStepping
from slipstream.zero.whole_tensors import attach_whole_tensors

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass(frozen=True, slots=True)
class GroupOver:
    """A param group reduced over another process group than the optimizer's (see `group_for`)."""

    group: dist.ProcessGroup | None


GroupFor = Callable[[dict], "GroupOver | None"]


@dataclasses.dataclass(frozen=True, slots=True)
class StepResult:
    grad_norm: float
    overflow: bool


class ZeroOptimizer(SubGroupStepping, abc.ABC):
    """Wraps a torch optimizer whose param groups are re-pointed at the flat master pieces; its offload policy
    steps it through `SubGroupStepping` (zero/sub_group_step.py)."""

    owns_all: bool = False
    full_grad_storage: bool = True
    span_step: SpanStep | None = None  # stages 1-2: phases 3-4 span by span (zero/span_step.py)

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        zero: ZeroPlan,
        precision: PrecisionPlan,
        offload: OffloadPolicy | None = None,
        group: dist.ProcessGroup | None = None,
        model: Any = None,
        group_for: GroupFor | None = None,
    ) -> None:
        """The stage reads its knobs from `zero` and `precision` (config/plan.py); `model` is stage 3's
        ZeroModel (Stage3Optimizer reads it), None below stage 3. `group_for(param_group)` names the process
        group a param group is reduced and sharded over when it is not `group` (MoE experts: their
        expert-data-parallel group; see [Note: param groups over other process groups])."""
        self.optimizer = optimizer
        self.zero, self.precision = zero, precision
        self.process_group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._group_for = group_for
        self.check_overflow = precision.check_grad_overflow
        # [Note: gradients divided on arrival] prescale_gradients / gradient_predivide_factor: each gradient is
        # divided by this before it is reduced (stages 0-2: on arrival, before it is accumulated; stage 3: in its
        # unit's staging rows, in the communication dtype, just before the reduce-scatter); the engine's step
        # divisor is divided by it (D7), so the step divides by world / factor after the reduction
        predivide = self.world_size if precision.grad_predivide is None else precision.grad_predivide
        self.pre_divided = float(predivide)
        self.state_dtype = DTYPES[precision.optimizer_state_dtype]
        """The dtype of the optimizer's moments (bf16 with `bf16_optimizer_states`); a loaded state takes it."""
        master_dtype, grad_dtype = precision.master_dtype, precision.grad_accum_dtype
        bucket_numel = self._layout_bucket_numel(int(zero.reduce_bucket_size), DTYPES[grad_dtype])
        self.offload = offload if offload is not None else OffloadPolicy()
        self.overflow = False
        self._settled = False  # phase 1 already ran for this step (settle_gradients): the step skips it
        self.param_names: dict[int, str] = {}
        """id(parameter) -> qualified name, set by the engine for error messages."""
        self.last_nonfinite_param: str | None = None
        self.model_parallel: tuple[dist.ProcessGroup, set[int]] | None = None
        """Tensor parallelism: (the TP group, ids of the parameters replicated over it), set by the engine; the
        global gradient norm then sums the sharded parameters over the group and counts replicated ones once."""
        self.at_boundary: Callable[[], bool] = lambda: False
        """Whether the backward now running is the last before the optimizer step (set by the engine: the
        accumulation boundary, outside no_sync); stage 1 with overlap_comm then reduces buckets as they fill."""
        self._hooks: list[Any] = []
        self.master_rounding = master_rounding(precision)  # the new masters' rounding (precision/masters.py)
        self.groups: list[Any] = self._build_groups(
            bucket_numel=bucket_numel, master_dtype=DTYPES[master_dtype], grad_dtype=DTYPES[grad_dtype]
        )
        self._repoint_optimizer()
        self._low_precision_out = self._low_precision_targets()  # fixed for the optimizer's lifetime
        self._low_precision_by_group = self._split_by_group(self._low_precision_out)
        self.offload.prepare(self)
        attach_whole_tensors(self, offload_in_files=self.offload.in_files)  # LAMB, Muon: [Note: whole-tensor map]

    def _layout_bucket_numel(self, reduce_bucket_size: int, grad_dtype: torch.dtype) -> int:
        """Elements per bucket of the flat layout (stage 2 bounds it, [Note: stage-2 staging bound])."""
        return reduce_bucket_size

    def _build_groups(self, *, bucket_numel: int, master_dtype: torch.dtype, grad_dtype: torch.dtype) -> list[Any]:
        """One FlatGroup per param group with trainable parameters; gradients arrive through hooks."""
        groups: list[FlatGroup] = []
        self._param_location: dict[int, tuple[FlatGroup, int]] = {}
        for hyper in self.optimizer.param_groups:
            params = [p for p in hyper["params"] if p.requires_grad]
            if not params:
                continue
            over = self._group_for(hyper) if self._group_for is not None else None
            process_group = over.group if over is not None else self.process_group
            world = dist.get_world_size(process_group)
            numels, dtypes = [p.numel() for p in params], [reduce_dtype_of(p) for p in params]  # dtypes: autocast's
            layout = build_layout(numels, world_size=world, bucket_numel=bucket_numel, reduce_dtypes=dtypes)
            flat = FlatGroup(
                params,
                layout=layout,
                rank=dist.get_rank(process_group),
                owns_all=self.owns_all,
                master_dtype=master_dtype,
                grad_dtype=grad_dtype,
                full_grad_storage=self.full_grad_storage,
                offload=self.offload,
            )
            flat.process_group, flat.world_size = process_group, world
            groups.append(flat)
            for index, param in enumerate(params):
                self._param_location[id(param)] = (flat, index)
                self._hooks.append(param.register_post_accumulate_grad_hook(self._on_grad))
        return groups

    def _repoint_optimizer(self) -> None:
        """Give the wrapped optimizer the master pieces instead of the model parameters (state reset)."""
        hypers = [
            {k: v for k, v in g.items() if k != "params"}
            for g in self.optimizer.param_groups
            if any(p.requires_grad for p in g["params"])
        ]
        self.optimizer.param_groups = []
        self.optimizer.state.clear()
        for hyper, flat in zip(hypers, self.groups):
            self.optimizer.add_param_group({**hyper, "params": flat.master_pieces})

    # ---- gradients ----
    def _on_grad(self, param: torch.Tensor) -> None:
        flat, index = self._param_location[id(param)]
        if param.grad is None:
            return
        if param.grad.is_sparse:  # nn.Embedding(sparse=True): its rows, added into dense storage like any gradient
            param.grad = param.grad.to_dense()
        if self.pre_divided != 1.0:  # see [Note: gradients divided on arrival]
            param.grad.mul_(1.0 / self.pre_divided)
        self._accumulate(flat, index, param.grad)
        param.grad = None

    def _accumulate(self, flat: FlatGroup, index: int, grad: torch.Tensor) -> None:
        """Take one parameter's fresh gradient (from its post-accumulate-grad hook): add it to full storage."""
        if self._settled:
            raise RuntimeError(
                f"a gradient arrived for {self.param_names.get(id(flat.params[index]), 'a parameter')} after the "
                "gradients of this step were reduced for reading (safe_get_full_grad and the other gradient "
                "accessors reduce them at ZeRO stages 0 and 1): call the accessors after the last backward "
                "of the step, just before engine.step()"
            )
        flat.full_grad_view(index).add_(grad.reshape(-1))

    @abc.abstractmethod
    def _reduce_for_step(self) -> None:
        """Phase 1: leave the summed (not yet averaged) gradients in the owned grad storage."""

    def settle_gradients(self) -> None:
        """Run phase 1 now, before the step, so the owned grad storage holds this step's summed gradients
        (the gradient accessors read and write them there); the step then skips it. Collective: every rank
        calls it, after the last backward of the step."""
        if self._settled:
            return
        self.micro_step_done(reduce=True)
        self._reduce_for_step()
        self._settled = True

    def micro_step_done(self, *, reduce: bool) -> None:
        """Called after every micro-batch's backward; stage 2 reduces here (`reduce=False` under no_sync)."""

    def zero_grad(self) -> None:
        for flat in self.groups:
            flat.grad_storage.zero_()
        self._settled = False

    # ---- the step ----
    def step(self, *, grad_divisor: float, clip: float) -> StepResult:
        """Phases 1-4; skips phases 3-4 (and reports overflow) when a gradient is not finite."""
        result = self._settle_and_measure(grad_divisor)
        if result.overflow:
            return result
        if clip > 0 and result.grad_norm > clip:
            self._clip_grads(clip / (result.grad_norm + 1e-6))
        self._update_from([flat.grads_for_optimizer() for flat in self.groups])
        self.zero_grad()
        return result

    def _clip_grads(self, coef: float) -> None:
        """Multiply the owned (already divided) gradients by the clip coefficient `coef`."""
        for flat in self.groups:
            for grad in flat.owned_grads:
                grad.mul_(coef)

    def _settle_and_measure(self, grad_divisor: float) -> StepResult:
        """Phases 1-2 without the clipping: reduce, divide by `grad_divisor`, the global norm and the overflow
        check (on overflow the gradients are dropped)."""
        if not self._settled:
            self._reduce_for_step()
        stats = self._grad_stats(grad_divisor)
        sum_sq, nonfinite = float(stats[0]), float(stats[1])
        self.overflow = self.check_overflow and (nonfinite > 0 or not math.isfinite(sum_sq))
        grad_norm = math.sqrt(sum_sq) if math.isfinite(sum_sq) else float("inf")
        if self.overflow:
            self.last_nonfinite_param = self.first_nonfinite_param(self.param_names)
            self.zero_grad()
        return StepResult(grad_norm=grad_norm, overflow=self.overflow)

    def _grad_stats(self, grad_divisor: float) -> torch.Tensor:
        """Divide the owned gradients by `grad_divisor`; [global sum of squares, non-finite count] (float64)."""
        owned = [g for flat in self.groups for g in flat.owned_grads]
        for grad in owned:
            grad.mul_(1.0 / grad_divisor)
        if self._other_groups():  # MoE: param groups on their own process groups (TP with MoE is refused)
            stats = self._weighted_grad_stats()
            collectives.all_reduce(stats)
        else:
            stats = self._local_grad_stats(owned)
            if self.model_parallel is not None:
                stats[0] -= self._replicated_sum_sq(self.model_parallel)
            if not self.owns_all and self.world_size > 1:
                collectives.all_reduce(stats, group=self.process_group)
            if self.model_parallel is not None:
                collectives.all_reduce(stats, group=self.model_parallel[0])
        return stats

    def _update_from(self, grads: list[list[torch.Tensor]]) -> None:
        """Phases 3-4 with `grads[g][p]` as the gradient of master piece p of group g (where the masters live)."""
        for flat, group_grads in zip(self.groups, grads):
            for piece, grad in zip(flat.master_pieces, group_grads):
                piece.grad = grad
        if self.offload.on_host:
            get_accelerator().synchronize()  # device -> host gradient copies are complete
        if self.span_step is not None:  # [Note: overlapped gather of the updated pieces] in span_step.py
            return self.span_step.run(self)
        copied = self.offload.run_step(self)  # phase 3 (and the copy of phase 4 when the policy did it)
        self._publish_params(from_low_precision=bool(self._low_precision_out), copied=copied)

    def gradients_resident(
        self, only: str | None = None, *, changed: bool = False
    ) -> contextlib.AbstractContextManager[None]:
        """The owned gradients (of the parameter named `only`, or all) readable in memory for the block;
        `changed`: the block writes them. Only stage 3 with NVMe offload keeps them elsewhere (in files)."""
        return contextlib.nullcontext()

    def resident_state(self) -> contextlib.AbstractContextManager[None]:
        """Masters and optimizer states in memory for the block (checkpoints); see the offload policy."""
        return self.offload.resident(self)

    def _other_groups(self) -> bool:
        return any(getattr(f, "process_group", self.process_group) is not self.process_group for f in self.groups)

    def _weighted_grad_stats(self) -> torch.Tensor:
        """[sum of squares, non-finite count] over the world when param groups live on different process
        groups: each group's owned squares divided by how many ranks of the world own the same elements, so
        one all-reduce over the world counts every element once."""
        total = torch.zeros(2, dtype=torch.float64, device=self.groups[0].device)
        for flat in self.groups:
            copies = flat.world_size if self.owns_all else 1
            stats = self._local_grad_stats(list(flat.owned_grads))
            total[0] += stats[0] / copies
            total[1] += stats[1]
        return total

    def _local_grad_stats(self, owned: list[torch.Tensor]) -> torch.Tensor:
        """[sum of squares, count of non-finite tensors] of the owned gradients, in float64."""
        if not owned:
            return torch.zeros(2, dtype=torch.float64, device=self.groups[0].device if self.groups else None)
        norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in owned]).double()
        return torch.stack([norms.pow(2).sum(), (~torch.isfinite(norms)).sum().double()])

    def _replicated_sum_sq(self, model_parallel: tuple[dist.ProcessGroup, set[int]]) -> float:
        """(1 - 1/tp) of the replicated parameters' share of the sum of squares: after the sum over the TP group
        they count once."""
        group, replicated = model_parallel
        share = 1.0 - 1.0 / dist.get_world_size(group)
        total = sum(
            float(torch.linalg.vector_norm(grad, dtype=torch.float32).double() ** 2)
            for param, grad in self.grad_parts()
            if id(param) in replicated
        )
        return share * total

    def grad_parts(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, the part of its owned gradient this rank holds), for every piece of owned gradient."""
        return [(flat.params[index], grad) for flat, index, grad in self._owned_grad_slices()]

    def _owned_grad_slices(self) -> Iterator[tuple[Any, int, torch.Tensor]]:
        """(flat group, parameter index in it, the part of that parameter's gradient this rank owns), for every
        non-empty piece, in group, bucket and parameter order."""
        for flat in self.groups:
            for bucket, (start, _end), grad in zip(flat.layout.buckets, flat.piece_ranges, flat.owned_grads):
                for index in bucket.param_indices:
                    slot = flat.layout.slots[index]
                    lo = max(slot.flat_offset, start) - start
                    hi = min(slot.flat_offset + slot.numel, start + grad.numel()) - start
                    if hi > lo:
                        yield flat, index, grad[lo:hi]

    def _publish_params(self, *, from_low_precision: bool, copied: bool = False) -> None:
        """Phase 4: every rank's flat params get the updated values (`copied`: already in the flat params)."""
        for flat in self.groups:
            if not copied:
                flat.copy_master_to_params(from_low_precision=from_low_precision)
            if not self.owns_all and flat.world_size > 1:
                flat.gather_params()

    # ---- introspection, DeepSpeed's surface ----
    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self) -> dict:
        """The wrapped optimizer's state, keyed by the master tensors it steps (DeepSpeed's wrappers forward it)."""
        return self.optimizer.state

    def first_nonfinite_param(self, names: dict[int, str]) -> str | None:
        """Name of the first parameter whose owned gradient slice is not finite (before it is zeroed)."""
        for flat, index, grad in self._owned_grad_slices():
            if not bool(torch.isfinite(grad).all()):
                return names.get(id(flat.params[index]), f"<param {index}>")
        return None

    def owned_bytes(self) -> dict[str, int]:
        """Bytes of every tensor this optimizer owns, by role: params, master, grads, optimizer_state."""
        total = {"params": 0, "master": 0, "grads": 0, "optimizer_state": 0, "host_buffers": 0, "comm_buffers": 0}
        for flat in self.groups:
            for key, value in flat.owned_bytes().items():
                total[key] += value
        for state in self.optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    total["optimizer_state"] += value.numel() * value.element_size()
        for key, value in getattr(self.optimizer, "owned_bytes", dict)().items():  # held outside `state` (1-bit)
            total[key] += value
        total["comm_buffers"] += self._comm_buffer_bytes()
        return total

    def host_bytes_needed(self) -> int:
        """Host memory the offload of this rank needs at its peak: masters, two Adam states per master element
        and the staging buffers, plus parameter shards offloaded to the host. With NVMe offload only two
        sub-groups' masters and states are in memory at once (the one being updated and the next, being read),
        and at stage 3 a few sub-groups' gradients (offload/grad_swap.py)."""
        owned = self.owned_bytes()
        if not self.offload.on_host:
            return owned.get("offloaded_params", 0)
        masters = [b.numel() * b.element_size() for f in self.groups for b in f.master_buffers]
        grads = [b.numel() * b.element_size() for f in self.groups for b in getattr(f, "grad_buffers", [])]
        return (
            self.offload.resident_master_bytes(masters) * 3
            + self.offload.resident_grad_bytes(grads)
            + owned["host_buffers"]
            + owned.get("offloaded_params", 0)
        )

    def _comm_buffer_bytes(self) -> int:
        """Bytes of the reusable communication buffers (stage 2's staging and receive buffers)."""
        return 0

    def trainable_params(self) -> list[torch.Tensor]:
        return [p for flat in self.groups for p in flat.params]

    def owned_slices(self, names: dict[int, str], *, for_save: bool, only: str | None = None) -> list[OwnedSlice]:
        """This rank's part of every trainable parameter (see zero/slices.py), or of the one named `only`. At
        stage 0 every rank holds everything; for a save each rank takes its stage-1 piece, so the ranks write
        disjoint parts."""
        out: list[OwnedSlice] = []
        for number, flat in enumerate(self.groups):
            for b, index, a, z in self.owned_ranges(flat, for_save=for_save):
                param = flat.params[index]
                if only is not None and names[id(param)] != only:
                    continue
                start, offset = flat.piece_ranges[b][0], flat.layout.slots[index].flat_offset
                out.append(
                    OwnedSlice(
                        name=names[id(param)],
                        shape=tuple(param.shape),
                        lo=a - offset,
                        hi=z - offset,
                        value=flat.flat_params[a:z],
                        master=flat.master_pieces[b][a - start : z - start],
                        piece=flat.master_pieces[b],
                        piece_offset=a - start,
                        group_index=number,
                        grad=flat.owned_grads[b][a - start : z - start],
                    )
                )
        return out

    def owned_ranges(self, flat: FlatGroup, *, for_save: bool = False) -> Iterator[tuple[int, int, int, int]]:
        """(bucket, parameter index, flat [a, z)) of each parameter part of `flat` this rank owns. At stage 0
        every rank owns everything; for a save each rank takes its stage-1 piece."""
        for b, (bucket, (start, end)) in enumerate(zip(flat.layout.buckets, flat.piece_ranges)):
            lo_cut, hi_cut = (
                flat.layout.piece_range(bucket, flat.rank) if (self.owns_all and for_save) else (start, end)
            )
            for index in bucket.param_indices:
                slot = flat.layout.slots[index]
                a, z = max(slot.flat_offset, lo_cut), min(slot.flat_offset + slot.numel, hi_cut)
                if z > a:
                    yield b, index, a, z

    def publish_loaded(self) -> None:
        """After a checkpoint wrote the master pieces: every rank's parameters take the loaded values."""
        self._publish_params(from_low_precision=False)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

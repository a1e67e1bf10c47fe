"""`ZeroModel`: turns a module's parameters into ZeRO-3 units and owns them (the stage-3 side of the engine).

Built once per model, by the engine at stage 3 or by `zero.Init(module=...)`. Parameters already sharded
(by `zero.Init` while the model was built, or by an earlier ZeroModel) are read by gathering their old
unit, one at a time, so re-sharding never needs the whole model in memory. Values are broadcast from
rank 0 when they come from plain (unsharded) parameters, so every rank starts from rank 0's model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from slipstream.comm import collectives
from slipstream.comm.nodes import two_level_groups
from slipstream.config.plan import Stage3Plan
from slipstream.offload.choose import policy_for
from slipstream.precision.fp8 import float8_gather_slots
from slipstream.utils.host_memory import cap_mmap_threshold
from slipstream.zero.comm_stream import CommStream
from slipstream.zero.slices import OwnedSlice
from slipstream.zero.stage3.coordinator import Coordinator
from slipstream.zero.stage3.hierarchical_gather import hierarchical_gather
from slipstream.zero.stage3.leaves import LEAF_PARAM_ATTR, apply_leaf_settings, get_z3_leaf_modules
from slipstream.zero.stage3.loco import KeptErrors
from slipstream.zero.stage3.manager import UnitManager
from slipstream.zero.stage3.pool import BufferPool
from slipstream.zero.stage3.quantized_reduce import QuantizedReduceScatter, node_levels
from slipstream.zero.stage3.secondary import SecondaryShard
from slipstream.zero.stage3.sharded_param import ShardedParameter, ZeroParamStatus, internal_access
from slipstream.zero.stage3.sharding import shard_groups
from slipstream.zero.stage3.unit import Unit, UnitMemory, host_or_device_allocator
from slipstream.zero.stage3.units import UnitSpec, plan_units


class ZeroModel(UnitManager):
    """The units of one module, their hooks (coordinator) and the gather/release API used by the helpers."""

    def __init__(
        self,
        module: nn.Module,
        plan: Stage3Plan,
        *,
        device: torch.device,
        group: dist.ProcessGroup | None = None,
        attach_hooks: bool = True,
        unit_groups: UnitGroups | None = None,
    ) -> None:
        """`unit_groups(key)` -> (process group, global source rank) for units marked with a group key (MoE
        experts, units.py [Note: units over other groups])."""
        self.module, self.plan, self.device, self.group = module, plan, device, group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.pool = BufferPool(device)
        self._deferred_tags = []
        _mark_leaves(module, plan)
        specs = plan_units(module, threshold=plan.persistence_threshold)
        self.sharding = shard_groups(group, _checked_shard_size(plan, specs))  # [Note: MiCS shard groups]
        self._hierarchy = hierarchical_gather(self.sharding.shard, self.pool) if plan.hierarchical_gather else None
        offload = policy_for(plan.offload_param, rank=self.rank, section="offload_param")
        self.shards_in_host_memory = offload.host_resident
        if offload.on_host:  # parameter offload asks for the least host memory ([Note: glibc's mmap threshold])
            cap_mmap_threshold()
        memory = UnitMemory(
            device=device,
            shard_device=offload.master_device(device),
            pool=self.pool,
            allocate_shard=host_or_device_allocator(offload.pins),
            store=offload.make_param_store(),  # None: a ShardStore (unit.py), in memory
        )
        previous = zero_model_of(module)
        if previous is not None:
            previous.detach_hooks()
        self.units: list[Unit] = []
        self._fp8_weights = float8_gather_slots(module)  # their hook gathers travel in float8 (fp8_gather.py)
        for uid, spec in enumerate(specs):
            self.units.append(self._build_unit(uid, spec, unit_groups=unit_groups, memory=memory))
        for unit in self.units:
            if unit.persistent:
                unit.refresh_persistent()
        self._attach_secondaries(plan.secondary_shard_size)
        self.coordinator = Coordinator(
            self.units,
            self._borrowing(specs),
            prefetch_numel=plan.prefetch_numel,
            max_live_numel=plan.max_live_numel,
            reuse_distance=plan.reuse_distance,
        )
        if attach_hooks:
            self.coordinator.attach(module)
        module._slipstream_zero_model = self  # type: ignore[assignment]

    def _build_unit(
        self,
        uid: int,
        spec: UnitSpec,
        *,
        unit_groups: UnitGroups | None,
        memory: UnitMemory,
    ) -> Unit:
        """One unit: its parameters read out of the units that held them before (re-sharding), plain values
        broadcast from the unit group's source rank, then sharded; an old unit is freed once it holds nothing."""
        old_units = _sharded_owners(spec)
        for old in old_units:
            old.finish_gather()
        unit_group, source = _unit_group(spec, self.group, unit_groups)
        unit_world = dist.get_world_size(unit_group)
        plain = [p for _, p in spec.params if not isinstance(p, ShardedParameter)]
        if plain and unit_world > 1:
            with torch.no_grad():
                for param in plain:
                    collectives.broadcast(param.data, src=source, group=unit_group)
        shard_group = self.sharding.shard if spec.group_key is None else unit_group  # MiCS: a block of the group
        unit = Unit(
            uid,
            spec,
            manager=self,
            rank=dist.get_rank(shard_group),
            world_size=dist.get_world_size(shard_group),
            group=shard_group,
            memory=memory,
            quantize_gathers=self.plan.quantized_weights
            or (self.plan.quantized_frozen_weights and not any(p.requires_grad for _, p in spec.params)),
            fp8_slots={
                i: self._fp8_weights[id(p)] for i, (_, p) in enumerate(spec.params) if id(p) in self._fp8_weights
            },
        )
        if self.plan.quantized_gradients and unit.world_size > 1:  # ZeRO++ qgZ (quantized_reduce.py)
            loco = None if self.plan.loco is None else KeptErrors(self.plan.loco, self.pool)  # ZeRO++ LoCo (loco.py)
            unit.quantized_reduce = QuantizedReduceScatter(node_levels(unit.group), self.pool, loco)
        if spec.group_key is None:  # MiCS' two-step gather (hierarchical_gather.py) over the shard group
            unit.hierarchical = self._hierarchy
        for old in old_units:  # re-sharded: free an old unit once none of its parameters is left in it
            if all(p.ds_record.unit is not old for p in old.params if isinstance(p, ShardedParameter)):
                old.discard()
        return unit

    def _borrowing(self, specs: list[UnitSpec]) -> dict[int, list[Unit]]:
        """For each hooked unit: itself, then the units owning parameters its modules use (weight tying)."""
        owner = {id(p): unit for unit in self.units for p in unit.params}
        hooked = {id(u.module): u for u in self.units if u.module is not None}
        borrow: dict[int, list[Unit]] = {}
        for unit in self.units:
            if unit.module is None:
                continue
            needed = [unit]
            stack = [unit.module]
            while stack:
                module = stack.pop()
                for param in module.parameters(recurse=False):
                    other = owner.get(id(param))
                    if other is not None and not other.persistent and other not in needed:
                        needed.append(other)
                for param in getattr(module, "_z3_external_params", ()):
                    other = owner.get(id(param))
                    if other is not None and not other.persistent and other not in needed:
                        needed.append(other)
                stack.extend(c for c in module.children() if id(c) not in hooked)
            borrow[unit.uid] = needed
        return borrow

    def _attach_secondaries(self, size: int) -> None:
        """ZeRO++ hpZ: a secondary shard over blocks of `size` ranks for every unit gathered by the hooks over the
        whole group (see [Note: hpZ secondary shard]); none when one block is the whole group. Float8 weights'
        gathers stay primary (their float8 copy is valid only for the gather that made it)."""
        if size <= 1:
            return
        layout = two_level_groups(self.group, size, what="zero_optimization.zero_hpz_partition_size")
        if layout.inner is None or layout.count == 1:
            return
        for unit in self.units:
            if unit.persistent or unit.group is not self.group or unit.float8 is not None or not unit.params:
                continue
            unit.secondary = SecondaryShard(
                full_numel=unit.layout.full_numel, dtype=unit.dtype, device=self.device, block=layout.inner, size=size
            )

    def use_comm_stream(self, comm: CommStream) -> None:
        """Launch the units' gathers on the engine's communication stream (the one its gradient reductions use;
        [Note: the communication stream] in zero/comm_stream.py). A no-op stream changes nothing."""
        for unit in self.units:
            unit.comm = comm if comm.stream is not None else None

    def shards_changed(self) -> None:
        """The shards took new values (a step, a checkpoint load): the secondary shards are stale."""
        for unit in self.units:
            if unit.secondary is not None:
                unit.secondary.filled = False

    def detach_hooks(self) -> None:
        self.coordinator.detach()

    def _hold(self, unit: Unit, delta: int) -> int:
        state = self.coordinator.state[unit.uid]
        state.holds = max(0, state.holds + delta)
        return state.holds

    # ---- figures ----
    def owned_bytes(self) -> dict[str, int]:
        shards = sum(u.shard.numel() * u.shard.element_size() for u in self.units)
        own = sum(u.full.untyped_storage().nbytes() for u in self.units if not u.holds_lent_memory)
        gathered = own + self.pool.gathered_bytes  # lent memory is the pool's, idle or lent (pool.py)
        secondary = sum(u.secondary.nbytes for u in self.units if u.secondary is not None)
        kept = sum(u.quantized_reduce.kept_bytes for u in self.units if u.quantized_reduce is not None)  # LoCo's
        return {
            "params": shards + secondary,
            "gathered": gathered,
            "comm_buffers": self.pool.allocated_bytes + kept,
            "offloaded_params": shards if self.shards_in_host_memory else 0,
        }

    def full_state(
        self, *, dtype: torch.dtype | None = None, only_rank0: bool = True, exclude_frozen: bool = False
    ) -> dict[str, torch.Tensor]:
        """The whole model's parameters on the host, gathered one unit at a time (rank 0 only by default)."""
        out: dict[str, torch.Tensor] = {}
        for unit in self.units:
            self.gather_units([unit])
            try:
                if not only_rank0 or self.rank == 0:
                    with internal_access():
                        for record, param in zip(unit.records, unit.params):
                            if exclude_frozen and not param.requires_grad:
                                continue
                            value = param.detach().to("cpu", copy=True)
                            out[record.name] = value if dtype is None else value.to(dtype)
            finally:
                self.release_units([unit])
        return out

    def value_slices(self, names: dict[int, str], *, skip: set[str]) -> list[OwnedSlice]:
        """This rank's slice of every parameter not in `skip` (frozen ones, or all without an optimizer)."""
        out = []
        for unit in self.units:
            for record, param in zip(unit.records, unit.params):
                name = names.get(id(param), record.name)
                part = None if name in skip else record.owned_values(name)
                if part is not None:
                    out.append(part)
        return out

    @contextlib.contextmanager
    def resident_shards(self) -> Iterator[None]:
        """Every shard in memory for the block (checkpoints), written back after (parameter NVMe offload)."""
        for unit in self.units:
            unit.store.fetch(unit.shard)
        try:
            yield
        finally:
            for unit in self.units:
                unit.store.release(unit.shard, dirty=True)

    def refresh_gathered(self) -> None:
        """After shards changed outside a step (a checkpoint load): re-gather the units that are gathered."""
        self.shards_changed()
        for unit in self.units:
            if unit.status is ZeroParamStatus.AVAILABLE and unit.params:
                unit.status = ZeroParamStatus.NOT_AVAILABLE
                unit.start_gather()
                unit.finish_gather()


UnitGroups = Callable[[str], tuple[Any, int]]


def _unit_group(
    spec: UnitSpec, group: dist.ProcessGroup | None, unit_groups: UnitGroups | None
) -> tuple[dist.ProcessGroup | None, int]:
    """The process group a unit is sharded over and the global rank its initial values come from."""
    if spec.group_key is None:
        return group, collectives.first_rank(group)
    if unit_groups is None:
        if spec.group_key == "ep_size_1":
            return group, collectives.first_rank(group)
        raise ValueError(
            f"ZeRO-3 unit '{spec.name}' holds experts of expert group '{spec.group_key}', which only the engine "
            "can place; build the model with MoE layers outside zero.Init(module=...) and let "
            "slipstream.initialize shard it"
        )
    found: tuple[dist.ProcessGroup | None, int] = unit_groups(spec.group_key)
    return found


def _checked_shard_size(plan: Stage3Plan, specs: list[UnitSpec]) -> int | None:
    """MiCS' shard size, after refusing what it does not combine with: hpZ (MiCS' gathers are inside its blocks
    already) and units over other process groups (MoE experts)."""
    if plan.shard_size is None:
        return None
    if plan.secondary_shard_size > 1:
        raise ValueError(
            f"zero_optimization.mics_shard_size={plan.shard_size} with zero_hpz_partition_size="
            f"{plan.secondary_shard_size}: MiCS keeps the gathers inside its shard groups already; set one of them only"
        )
    grouped = [spec.name for spec in specs if spec.group_key is not None]
    if grouped:
        raise ValueError(
            f"zero_optimization.mics_shard_size={plan.shard_size}: the model has units sharded over expert groups "
            f"({', '.join(grouped)}), which MiCS does not cut into shard groups; unset mics_shard_size for MoE models"
        )
    return plan.shard_size


def _mark_leaves(module: nn.Module, plan: Stage3Plan) -> None:
    """Mark the leaves the config names, then tag every parameter of a leaf with its outermost leaf
    (`z3_leaf_parameter`)."""
    apply_leaf_settings(module, plan.leaf_classes, plan.leaf_names, plan.leaf_suffixes)
    for leaf in get_z3_leaf_modules(module):  # pre-order: an outer leaf tags its parameters first
        for param in leaf.parameters():
            if getattr(param, LEAF_PARAM_ATTR, None) is None:
                setattr(param, LEAF_PARAM_ATTR, leaf)


def _sharded_owners(spec: UnitSpec) -> list[Unit]:
    owners: list[Unit] = []
    for _, param in spec.params:
        if isinstance(param, ShardedParameter) and param.ds_record.unit not in owners:
            owners.append(param.ds_record.unit)
    return owners


def zero_model_of(module: nn.Module) -> ZeroModel | None:
    return getattr(module, "_slipstream_zero_model", None)

"""`ZeroModel`: turns a module's parameters into ZeRO-3 units and owns them (the stage-3 side of the engine).

Built once per model, by the engine at stage 3 or by `zero.Init(module=...)`. Parameters already sharded
(by `zero.Init` while the model was built, or by an earlier ZeroModel) are read by gathering their old
unit, one at a time, so re-sharding never needs the whole model in memory. Values are broadcast from
rank 0 when they come from plain (unsharded) parameters, so every rank starts from rank 0's model.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from slipstream.comm import collectives
from slipstream.zero.slices import OwnedSlice
from slipstream.zero.stage3.coordinator import Coordinator
from slipstream.zero.stage3.manager import UnitManager
from slipstream.zero.stage3.pool import BufferPool
from slipstream.zero.stage3.sharded_param import ShardedParameter, ZeroParamStatus, internal_access
from slipstream.zero.stage3.unit import Unit, host_or_device_allocator
from slipstream.zero.stage3.units import UnitSpec, plan_units


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stage3Settings:
    """The stage-3 knobs (from the config's Stage3Plan, or zero.Init's defaults)."""

    persistence_threshold: int = 100_000
    prefetch_numel: int = 50_000_000
    max_live_numel: int = 1_000_000_000
    reuse_distance: int = 1_000_000_000
    offload_param: bool = False
    pin_memory: bool = False
    nvme_path: str | None = None
    """offload_param.device nvme: shards live in files under this directory (offload/nvme.py)."""
    aio: Any = None
    leaf_classes: tuple[type, ...] = ()
    leaf_class_names: tuple[str, ...] = ()
    leaf_names: tuple[str, ...] = ()
    """Module classes (by class or class name) and qualified module names that are units."""


class ZeroModel(UnitManager):
    """The units of one module, their hooks (coordinator) and the gather/release API used by the helpers."""

    def __init__(self, module: nn.Module, settings: Stage3Settings, *, device: torch.device,
                 group: dist.ProcessGroup | None = None, attach_hooks: bool = True) -> None:
        self.module, self.settings, self.device, self.group = module, settings, device, group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.pool = BufferPool(device)
        self._deferred_tags = []
        _mark_leaves(module, settings)
        specs = plan_units(module, threshold=settings.persistence_threshold, leaf_classes=settings.leaf_classes)
        shard_device = torch.device("cpu") if settings.offload_param or settings.nvme_path else device
        allocate = host_or_device_allocator(settings.pin_memory and settings.offload_param)
        store: Any = None  # a ShardStore (unit.py) or offload/nvme.py's NVMeShardStore
        if settings.nvme_path:
            from slipstream.config.plan import AioPlan
            from slipstream.offload.nvme import NVMeShardStore

            store = NVMeShardStore(settings.nvme_path, self.rank, settings.aio or AioPlan())
        previous = zero_model_of(module)
        if previous is not None:
            previous.detach_hooks()
        self.units: list[Unit] = []
        for uid, spec in enumerate(specs):
            old_units = _sharded_owners(spec)
            for old in old_units:
                old.finish_gather()
            plain = [p for _, p in spec.params if not isinstance(p, ShardedParameter)]
            if plain and self.world_size > 1:
                with torch.no_grad():
                    for param in plain:
                        collectives.broadcast(param.data, src=0, group=group)
            self.units.append(Unit(uid, spec, manager=self, rank=self.rank, world_size=self.world_size, group=group,
                                   device=device, shard_device=shard_device, pool=self.pool, allocate_shard=allocate,
                                   store=store))
            for old in old_units:  # re-sharded: free an old unit once none of its parameters is left in it
                if all(p.ds_record.unit is not old for p in old.params if isinstance(p, ShardedParameter)):
                    old.persistent = False
                    old.release()
        for unit in self.units:
            if unit.persistent:
                unit.refresh_persistent()
        self.coordinator = Coordinator(self.units, self._borrowing(specs), prefetch_numel=settings.prefetch_numel,
                                       max_live_numel=settings.max_live_numel, reuse_distance=settings.reuse_distance)
        if attach_hooks:
            self.coordinator.attach(module)
        module._slipstream_zero_model = self  # type: ignore[assignment]

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

    def detach_hooks(self) -> None:
        self.coordinator.detach()

    def _hold(self, unit: Unit, delta: int) -> int:
        state = self.coordinator.state[unit.uid]
        state.holds = max(0, state.holds + delta)
        return state.holds

    # ---- figures ----
    def owned_bytes(self) -> dict[str, int]:
        shards = sum(u.shard.numel() * u.shard.element_size() for u in self.units)
        gathered = sum(u.full.untyped_storage().nbytes() for u in self.units)
        return {"params": shards, "gathered": gathered, "comm_buffers": self.pool.allocated_bytes,
                "offloaded_params": shards if self.settings.offload_param else 0}

    def full_state(self, *, dtype: torch.dtype | None = None, only_rank0: bool = True,
                   exclude_frozen: bool = False) -> dict[str, torch.Tensor]:
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
                lo, hi = min(record.numel, self.rank * record.shard_numel), min(record.numel, (self.rank + 1) * record.shard_numel)
                if name in skip or hi <= lo:
                    continue
                out.append(OwnedSlice(name=name, shape=tuple(record.shape), lo=lo, hi=hi,
                                      value=unit.shard[record.shard_offset: record.shard_offset + hi - lo]))
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
        for unit in self.units:
            if unit.status is ZeroParamStatus.AVAILABLE and unit.params:
                unit.status = ZeroParamStatus.NOT_AVAILABLE
                unit.start_gather()
                unit.finish_gather()



def _mark_leaves(module: nn.Module, settings: Stage3Settings) -> None:
    if not settings.leaf_class_names and not settings.leaf_names:
        return
    found = set()
    for name, child in module.named_modules():
        if type(child).__name__ in settings.leaf_class_names or name in settings.leaf_names:
            child._z3_leaf = True  # type: ignore[assignment]
            found.update({type(child).__name__, name})
    missing = sorted(set(settings.leaf_class_names + settings.leaf_names) - found)
    if missing:
        raise ValueError(f"zero_optimization.leaf_module names {missing}, which match no module class or module "
                         "name of the model; fix the names or remove them")


def _sharded_owners(spec: UnitSpec) -> list[Unit]:
    owners: list[Unit] = []
    for _, param in spec.params:
        if isinstance(param, ShardedParameter) and param.ds_record.unit not in owners:
            owners.append(param.ds_record.unit)
    return owners


def stage3_settings(plan: Any, aio: Any = None) -> Stage3Settings:
    """Settings from the config's Stage3Plan."""
    offload = plan.offload_param or {}
    nvme = offload.get("device") == "nvme"
    return Stage3Settings(persistence_threshold=int(plan.param_persistence_threshold),
                          prefetch_numel=int(plan.prefetch_bucket_size), max_live_numel=int(plan.max_live_parameters),
                          reuse_distance=int(plan.max_reuse_distance), offload_param=offload.get("device") == "cpu",
                          nvme_path=str(offload.get("nvme_path")) if nvme else None, aio=aio,
                          pin_memory=bool(offload.get("pin_memory", False)), leaf_class_names=tuple(plan.leaf_classes),
                          leaf_names=tuple(plan.leaf_names))


def zero_model_of(module: nn.Module) -> ZeroModel | None:
    return getattr(module, "_slipstream_zero_model", None)

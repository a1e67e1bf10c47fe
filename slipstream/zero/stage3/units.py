"""Which modules are ZeRO-3 units, and where each parameter sits in its unit's shard (pure; no collectives).

[Note: choosing units]
- Walking down from the root: the children of the first `nn.ModuleList`/`nn.ModuleDict` met on a path
  are units (the repeated blocks of a transformer; an MoE layer's expert list inside such a block stays
  in the block, so every rank gathers the same units whatever its routing); a child that holds such a
  container somewhere below is walked into; any other child with more sharded elements than
  `stage3_param_persistence_threshold` is a unit.
- A leaf module (marked with `set_z3_leaf_modules` & co., or named by `zero_optimization.leaf_module`;
  leaves.py) and a module marked `_z3_block` (an MoE layer) are units wherever the walk meets them,
  whatever their size, and nothing inside them is split further. A leaf inside a unit stays inside it
  (it is still gathered whole); a leaf root makes the whole model one unit (the root unit), which is how
  a model whose ranks run different submodules (rank- or data-dependent control flow) stays in step.
- [Note: units over other groups] A module marked `_z3_group_key` (an MoE layer's `Experts`: its value
  names the expert-data-parallel group) is a unit of its own, placed just before the unit that holds it,
  whose parameters never go to the persistent unit: it is sharded, gathered and reduced over that group,
  since ranks of other groups hold other experts under the same names.
- Parameters of no unit belong to the root unit (which exists even when it owns nothing, to gather
  what the root's own modules borrow). Parameters with fewer elements than the threshold
  belong to the persistent unit (gathered for good on every rank). A parameter shared by several modules
  (weight tying) belongs to the first unit that reaches it; units that use it gather that unit too.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from torch import nn

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


@dataclasses.dataclass(frozen=True, slots=True)
class UnitSpec:
    """One unit: its modules (hooks go on `module`), and the parameters it owns, by qualified name."""

    name: str
    module: nn.Module | None
    """None for the persistent unit (no hooks: always gathered)."""
    params: tuple[tuple[str, nn.Parameter], ...]
    persistent: bool = False
    group_key: str | None = None
    """Set for a module marked `_z3_group_key` (an MoE layer's experts): the unit is sharded over the process
    group of that name instead of the data-parallel group (see [Note: units over other groups])."""


@dataclasses.dataclass(frozen=True, slots=True)
class ShardLayout:
    """Per-parameter slices of a unit for `world_size` ranks (see [Note: ZeRO-3 vocabulary])."""

    world_size: int
    numels: tuple[int, ...]
    shard_numels: tuple[int, ...]
    """ceil(numel / world) per parameter."""
    shard_offsets: tuple[int, ...]
    full_offsets: tuple[int, ...]
    shard_numel: int
    full_numel: int
    """world * shard_numel: every parameter padded to world * its shard_numel."""


def shard_layout(numels: Sequence[int], world_size: int) -> ShardLayout:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    pieces = tuple(math.ceil(n / world_size) for n in numels)
    shard_offsets, full_offsets, shard, full = [], [], 0, 0
    for piece in pieces:
        shard_offsets.append(shard)
        full_offsets.append(full)
        shard += piece
        full += piece * world_size
    return ShardLayout(
        world_size=world_size,
        numels=tuple(numels),
        shard_numels=pieces,
        shard_offsets=tuple(shard_offsets),
        full_offsets=tuple(full_offsets),
        shard_numel=shard,
        full_numel=full,
    )


def _is_leaf_marked(module: nn.Module, leaf_classes: tuple[type, ...]) -> bool:
    return bool(getattr(module, "_z3_leaf", False)) or (bool(leaf_classes) and isinstance(module, leaf_classes))


def _holds_container(module: nn.Module) -> bool:
    return any(isinstance(m, _CONTAINERS) for m in module.modules())


def _choose_unit_modules(
    root: nn.Module, leaf_classes: tuple[type, ...], threshold: int
) -> list[tuple[str, nn.Module]]:
    if _is_leaf_marked(root, leaf_classes):
        return []  # one leaf: every parameter in the root unit

    def sharded_numel(module: nn.Module) -> int:
        return sum(p.numel() for p in module.parameters() if p.numel() >= threshold)

    units: list[tuple[str, nn.Module]] = []

    def walk(module: nn.Module, prefix: str, in_container: bool) -> None:
        for name, child in module.named_children():
            qualified = f"{prefix}{name}"
            if getattr(child, "_z3_block", False) or _is_leaf_marked(child, leaf_classes):
                units.append((qualified, child))
            elif isinstance(child, _CONTAINERS) and not in_container:
                walk(child, qualified + ".", True)
            elif in_container:
                if sharded_numel(child) > 0:
                    units.append((qualified, child))
            elif _holds_container(child):
                walk(child, qualified + ".", False)
            elif sharded_numel(child) > threshold:
                units.append((qualified, child))

    walk(root, "", False)
    return units


def plan_units(root: nn.Module, *, threshold: int, leaf_classes: tuple[type, ...] = ()) -> list[UnitSpec]:
    """The units of `root`, in registration order, then the root unit, then the persistent unit."""
    seen: set[int] = set()
    specs: list[UnitSpec] = []
    persistent: list[tuple[str, nn.Parameter]] = []

    def take(module: nn.Module, prefix: str) -> list[tuple[str, nn.Parameter]]:
        owned: list[tuple[str, nn.Parameter]] = []
        for name, param in module.named_parameters(prefix=prefix.rstrip("."), remove_duplicate=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            (persistent if param.numel() < threshold else owned).append((name, param))
        return owned

    def take_grouped(module: nn.Module, prefix: str) -> None:
        for name, inner in module.named_modules(prefix=prefix):
            key = getattr(inner, "_z3_group_key", None)
            if key is None:
                continue
            params = []
            for pname, param in inner.named_parameters(prefix=name, remove_duplicate=False):
                if id(param) not in seen:
                    seen.add(id(param))
                    params.append((pname, param))
            if params:
                specs.append(UnitSpec(name=name, module=inner, params=tuple(params), group_key=str(key)))

    for name, module in _choose_unit_modules(root, leaf_classes, threshold):
        take_grouped(module, name)
        owned = take(module, name + ".")
        # A unit whose parameters all belong to earlier units (a tied output head) owns nothing but still
        # needs its hooks, to gather the units it borrows from; so does the root.
        if owned or any(True for _ in module.parameters()):
            specs.append(UnitSpec(name=name, module=module, params=tuple(owned)))
    take_grouped(root, "")
    specs.append(UnitSpec(name="<root>", module=root, params=tuple(take(root, ""))))
    if persistent:
        specs.append(UnitSpec(name="<persistent>", module=None, params=tuple(persistent), persistent=True))
    return specs

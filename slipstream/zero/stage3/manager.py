"""`UnitManager`: gathering and releasing units on request, shared by the ZeroModel and zero.Init's staging.

Holds are counted per unit: a unit gathered by `gather_units` stays gathered (module hooks do not free it)
until as many `release_units` calls have dropped its count to zero. `broadcast_units` makes one rank's
changes to the gathered values everyone's (GatheredParameters with modifier_rank). The unit-tag checks of
accelerator gathers are deferred to the next step instead of forcing a device sync per gather.
"""

from __future__ import annotations

import abc

import torch
import torch.distributed as dist

from slipstream.comm import collectives
from slipstream.zero.stage3.unit import Unit, UnitOrderError


class UnitManager(abc.ABC):
    units: list[Unit]
    world_size: int
    group: dist.ProcessGroup | None
    _deferred_tags: list[tuple[torch.Tensor, float, str]]

    @abc.abstractmethod
    def _hold(self, unit: Unit, delta: int) -> int:
        """Change `unit`'s hold count by `delta`; return the new count."""

    def gather_units(self, units: list[Unit], *, expose: bool = False) -> None:
        """Gather `units` (in the given order, the same on every rank) and hold them until released.

        `expose`: user code sees the values and may keep aliases of them past the release (unit.py, [Note:
        aliases of gathered values]).
        """
        for unit in units:
            unit.start_gather()
        for unit in units:
            unit.finish_gather()
            self._hold(unit, +1)
            unit.exposed = unit.exposed or expose

    def release_units(self, units: list[Unit]) -> None:
        for unit in units:
            if self._hold(unit, -1) == 0:
                unit.release()

    def broadcast_units(self, units: list[Unit], src: int) -> None:
        """After rank `src` changed the gathered values: every rank takes them and keeps its slices."""
        for unit in units:
            if self.world_size > 1:
                collectives.broadcast(unit.full, src=src, group=self.group)
            unit.write_full_into_shard()

    def defer_tag_check(self, tags: torch.Tensor, expected: float, name: str) -> None:
        self._deferred_tags.append((tags.clone(), expected, name))

    def check_deferred_tags(self) -> None:
        pending, self._deferred_tags = self._deferred_tags, []
        for tags, expected, name in pending:
            self.check_tags(tags, expected, name)

    def check_tags(self, tags: torch.Tensor, expected: float, name: str) -> None:
        """Raise when the ranks' tags of one gather (a row per rank) show that they gathered different units."""
        if bool((tags != expected).any()):
            raise UnitOrderError(
                f"ZeRO-3 gather of unit '{name}' met other units on other ranks (by rank: "
                f"{self.unit_names_for_tags(tags.tolist())}): the ranks ran different modules at this point. Every "
                "rank must run the same sharding units in the same order; put rank-dependent branches (MoE experts, "
                "optional layers) inside one unit, e.g. slipstream.zero.set_z3_leaf_modules(model, [YourMoELayer])"
            )

    def unit_names_for_tags(self, tags: list[float]) -> list[str]:
        names = []
        for tag in tags:
            match = [u.name for u in self.units if u.tag == tag]
            names.append(" or ".join(match) if match else f"<tag {tag:g}>")
        return names

"""The stage-3 gather pool, gathered-buffer peak and held gradients, found by replaying the schedule (pure).

`zero/stage3/pool.py` keeps every gather buffer it ever allocated, one per unit in flight at once for each
buffer size, so its size depends on how far ahead the coordinator prefetches. This module replays the
steady-state step of [Note: ZeRO-3 schedule] (`zero/stage3/coordinator.py`) on unit sizes alone:
- construction: the persistent unit is gathered once (one buffer of its size);
- forward (order: the root unit, then the other hooked units in registration order): a unit's pre-hook
  finishes the gathers of the units it borrows from (gathering them now when not in flight), then starts
  gathers of the following units, skipping those already in flight or gathered, while their elements fit in
  `prefetch_bucket_size` (counted for new gathers only) and the live total stays within
  `max_live_parameters`; its post-hook frees what it holds (the root is held until the end of forward);
- backward (order: the root, then the others reversed): the same prefetch; a unit is freed after its own
  backward; the root when backward ends;
- the step re-gathers the persistent unit.
The first step records the order and gathers without prefetch; from the second step on the pool has the size
computed here. Gradients (`Stage3Optimizer.unit_ready`): a unit's full-size gradients (parameter dtype) are held
from the moment they are complete until the unit is reduce-scattered, and units are reduce-scattered strictly in
reverse unit order, the persistent unit first. The persistent unit is complete only when the backward of the
earliest unit holding one of its parameters is over, the root unit at the end of backward, so every unit that
completes before them keeps its gradients until then (`held_grads_peak_bytes`). One world: no gather buffers at all. Re-use within `stage3_max_reuse_distance` is not modelled
(a unit runs once per forward in the models this targets).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import NamedTuple


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class UnitShape:
    """One stage-3 unit as `zero/stage3/units.plan_units` makes it."""

    name: str
    numels: tuple[int, ...]
    trainable: tuple[bool, ...]
    persistent: bool = False
    hooked: bool = True
    """False for the persistent unit (no module, never freed)."""
    is_root: bool = False
    borrow: tuple[int, ...] = ()
    """Indices of the other units whose parameters this unit's modules use (weight tying)."""
    hosts: tuple[int, ...] = ()
    """Persistent unit: the hooked units whose modules hold its parameters (its gradients arrive with theirs)."""
    reduce_dtypes: tuple[str | None, ...] = ()
    """Per parameter, the dtype its gradients are reduced in under torch_autocast's safe modules (None: the ZeRO
    reduce dtype); empty when none is."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PoolFigures:
    pool_bytes: int
    """Bytes of every gather buffer the pool holds in steady state."""
    buffers: int
    gathered_peak_bytes: int
    """Largest total of gathered full buffers at any point (persistent unit included)."""
    held_grads_peak_bytes: int
    """Largest total of full-size gradients waiting for their unit's reduce-scatter."""


_NA, _INFLIGHT, _AVAILABLE = 0, 1, 2


class _Limits(NamedTuple):
    """Stage 3's prefetch limits, in elements: the prefetch bucket and the most gathered at once."""

    budget: int
    max_live: int


class _Replay:
    def __init__(self, units: Sequence[UnitShape], *, world: int, dtype_bytes: int) -> None:
        self.units, self.world, self.dtype_bytes = units, world, dtype_bytes
        self.shard = [sum(-(-n // world) for n in u.numels) for u in units]
        self.full = [world * s for s in self.shard]
        self.status = [_AVAILABLE if u.persistent else _NA for u in units]
        self.holds = [0] * len(units)
        self.free: dict[int, int] = collections.Counter()
        self.allocated: dict[int, int] = collections.Counter()
        self.gathered = sum(self.full[i] for i, u in enumerate(units) if u.persistent) * dtype_bytes
        self.gathered_peak = self.gathered

    def _uses_pool(self, i: int) -> bool:
        return self.world > 1 and bool(self.units[i].numels)

    def start(self, i: int) -> None:
        if self.status[i] != _NA:
            return
        self.status[i] = _INFLIGHT
        if self._uses_pool(i):
            size = self.world * (self.shard[i] + 1)
            if self.free[size]:
                self.free[size] -= 1
            else:
                self.allocated[size] += 1

    def finish(self, i: int) -> None:
        if self.status[i] == _NA:
            self.start(i)
        if self.status[i] != _INFLIGHT:
            return
        if self._uses_pool(i):
            self.free[self.world * (self.shard[i] + 1)] += 1
        self.status[i] = _AVAILABLE
        if not self.units[i].persistent:
            self.gathered += self.full[i] * self.dtype_bytes
            self.gathered_peak = max(self.gathered_peak, self.gathered)

    def release(self, i: int) -> None:
        if self.units[i].persistent or self.status[i] == _NA:
            return
        if self.status[i] == _INFLIGHT:
            self.finish(i)
        self.gathered -= self.full[i] * self.dtype_bytes
        self.status[i] = _NA

    def owners(self, i: int) -> list[int]:
        return [i, *self.units[i].borrow]

    def prefetch(self, order: Sequence[int], pos: int, limits: _Limits | None) -> None:
        """Start gathering the units from order[pos] on while they fit `limits` (None: no prefetching)."""
        if limits is None:
            return
        budget, max_live = limits
        live = sum(self.full[i] for i, u in enumerate(self.units) if self.status[i] != _NA and not u.persistent)
        for i in order[pos:]:
            if self.status[i] != _NA:
                continue
            size = self.full[i]
            if size > budget or live + size > max_live:
                break
            self.start(i)
            budget -= size
            live += size


def simulate_pool(
    units: Sequence[UnitShape], *, world: int, dtype_bytes: int, prefetch_numel: int, max_live_numel: int
) -> PoolFigures:
    """Replay two training steps (the first records the order) and return the pool and gathered figures."""
    replay = _Replay(units, world=world, dtype_bytes=dtype_bytes)
    persistent = [i for i, u in enumerate(units) if u.persistent]
    for i in persistent:  # construction: refresh_persistent gathers it once
        replay.status[i] = _NA
        replay.start(i)
        replay.finish(i)
    roots = [i for i, u in enumerate(units) if u.is_root and u.hooked]
    others = [i for i, u in enumerate(units) if u.hooked and not u.is_root]
    forward, backward = roots + others, roots + others[::-1]
    for limits in (None, _Limits(prefetch_numel, max_live_numel)):  # a step without prefetching, then with
        _forward(replay, forward, roots, limits)
        _backward(replay, backward, roots, limits)
        for i in persistent:  # the step re-gathers what is gathered: the persistent unit
            replay.status[i] = _NA
            replay.start(i)
            replay.finish(i)
    sizes = replay.allocated
    pool_bytes = sum(size * count for size, count in sizes.items()) * dtype_bytes
    return PoolFigures(
        pool_bytes=pool_bytes,
        buffers=sum(sizes.values()),
        gathered_peak_bytes=replay.gathered_peak,
        held_grads_peak_bytes=_held_gradients(units, others[::-1], dtype_bytes),
    )


def _held_gradients(units: Sequence[UnitShape], backward: list[int], dtype_bytes: int) -> int:
    """Peak bytes of complete gradients waiting for the reduce-scatter order (see the module doc)."""
    grads = [sum(n for n, t in zip(u.numels, u.trainable) if t) * dtype_bytes for u in units]
    last = [i for i in range(len(units)) if units[i].persistent or units[i].is_root]  # as Stage3Optimizer._order
    order = [i for i in [*[j for j in reversed(range(len(units))) if j not in last], *last] if grads[i]]
    done: set[int] = set()
    ready: set[int] = set()
    held = peak = position = 0
    for step in [*backward, None]:  # None: the end of backward completes everything left
        if step is not None:
            done.add(step)
        for i in order:
            if i in ready:
                continue
            unit = units[i]
            complete = (
                step is None
                or (i == step and not unit.persistent)
                or (unit.persistent and bool(unit.hosts) and set(unit.hosts) <= done)
            )
            if complete and not (unit.is_root and step is not None):
                ready.add(i)
                held += grads[i]
        peak = max(peak, held)
        while position < len(order) and order[position] in ready:
            held -= grads[order[position]]
            position += 1
    return peak


def _forward(replay: _Replay, order: list[int], roots: list[int], limits: _Limits | None) -> None:
    for pos, i in enumerate(order):
        for owner in replay.owners(i):
            replay.finish(owner)
            replay.holds[owner] += 1
        replay.prefetch(order, pos + 1, limits)
        if i not in roots:
            _drop_holds(replay, i)
    for i in roots:
        _drop_holds(replay, i)
    for i in range(len(replay.units)):  # prefetched but unused
        if replay.holds[i] == 0 and replay.status[i] == _INFLIGHT:
            replay.release(i)


def _drop_holds(replay: _Replay, i: int) -> None:
    for owner in replay.owners(i):
        replay.holds[owner] -= 1
        if replay.holds[owner] == 0:
            replay.release(owner)


def _backward(replay: _Replay, order: list[int], roots: list[int], limits: _Limits | None) -> None:
    for pos, i in enumerate(order):
        for owner in replay.owners(i):
            replay.finish(owner)
        replay.prefetch(order, pos + 1, limits)
        if i not in roots:
            for owner in replay.owners(i):
                replay.release(owner)
    for i in range(len(replay.units)):
        replay.release(i)

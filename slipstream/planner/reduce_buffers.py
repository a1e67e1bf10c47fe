"""The gradient-reduction buffers by reduce dtype: what `zero/staging.py` and `zero/stage3/dtype_split.py`
allocate, counted from the layout and the units alone (pure).

[Note: reduction buffers by dtype]
Under `torch_autocast` with `lower_precision_safe_modules` the safe modules' parameters have their gradients
reduced in the autocast dtype and the rest in the ZeRO reduce dtype R (`communication_data_type`, else the
gradient-accumulation dtype G); the layout keeps each bucket to one reduce dtype ([Note: buckets by reduce
dtype] in zero/layout.py). With one reduce dtype these are the formulas the planner always had. For a dtype d
of b_d bytes, over the buckets reduced in d, let p_d be the largest piece:
- with the chunk c (`stage2_chunk_numel`, the staging bound's share per rank) and n_d = min(p_d, c), a ring
  has two slots of a staging (world x n_d) and a receive (n_d) buffer per dtype: 2 (world + 1) n_d b_d;
- stages 0 and 1 (`StepReducer`): buckets in G are reduced in place; every other dtype has a ring's buffers,
  reduced in chunks, so they stay within the bound at any `reduce_bucket_size`; nothing on one rank;
- stage 2 (`Stage2Optimizer`'s ring): a ring's buffers for every dtype, R always among them (n_R = 0 when no
  bucket is in R);
- stage 3: the ring stays in R, sized by the largest unit's trainable shard; a unit whose trainable parameters
  are not all in R is reduce-scattered once per dtype d it holds, its part of s_d shard elements taking a
  receive buffer (s_d, d) from the unit pool and, for d other than R, rows (world x s_d, d) (R's rows are the
  front of the ring's slot). Buffers go back to the pool when the unit's reduction completes: two reductions
  later with overlap_comm (the ring's two slots), at once without; the pool keeps, per (size, dtype), as many
  buffers as were in use at once, which `split_pool_bytes` finds by replaying the reduce order (reverse unit
  order, the persistent and root units last). A size that equals a gather buffer's is counted apart here.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from slipstream.planner.prefetch import UnitShape
from slipstream.planner.types import DTYPE_BYTES
from slipstream.zero.layout import GroupLayout, bounded_pieces

_NUM_SLOTS = 2


def _ring_bytes(per_dtype: dict[str, int], world: int) -> int:
    """Two slots of a staging (world x n_d) and a receive (n_d) buffer per dtype."""
    return sum(_NUM_SLOTS * (world + 1) * n * DTYPE_BYTES[d] for d, n in per_dtype.items())


def step_reducer_bytes(layout: GroupLayout, *, reduce_dtype: str, storage_dtype: str) -> int:
    """Stages 0 and 1: the staging ring for the buckets not reduced in the storage dtype."""
    if layout.world_size == 1:
        return 0
    per_dtype = bounded_pieces([layout], reduce_dtype, DTYPE_BYTES[storage_dtype])
    return _ring_bytes({d: n for d, n in per_dtype.items() if d != storage_dtype}, layout.world_size)


def stage2_ring_bytes(layout: GroupLayout, *, reduce_dtype: str, grad_bytes: int) -> int:
    """Stage 2: the ring's staging and receive buffers, per dtype, for chunks of `stage2_chunk_numel`."""
    per_dtype = bounded_pieces([layout], reduce_dtype, grad_bytes)
    per_dtype.setdefault(reduce_dtype, 0)
    return _ring_bytes(per_dtype, layout.world_size)


def reduce_order(units: Sequence[UnitShape]) -> list[int]:
    """The units with trainable parameters in the order stage 3 reduces them (`Stage3Optimizer._reduce_order`)."""
    last = [i for i, u in enumerate(units) if u.persistent or u.is_root]
    rest = [i for i in range(len(units)) if i not in last]
    return [i for i in [*reversed(rest), *last] if any(units[i].trainable)]


def _split_keys(unit: UnitShape, *, world: int, reduce_dtype: str) -> list[tuple[int, str]]:
    """The (elements, dtype) pool buffers one unit's split reduce-scatter takes (none when all are in R)."""
    parts: dict[str, int] = collections.defaultdict(int)
    for numel, trainable, dtype in zip(unit.numels, unit.trainable, unit.reduce_dtypes or [None] * len(unit.numels)):
        if trainable:
            parts[dtype or reduce_dtype] += -(-numel // world)
    if set(parts) <= {reduce_dtype}:
        return []
    keys = [(total, d) for d, total in parts.items()]
    return keys + [(total * world, d) for d, total in parts.items() if d != reduce_dtype]


def split_pool_bytes(units: Sequence[UnitShape], *, world: int, reduce_dtype: str, overlap: bool) -> int:
    """Stage 3: the pool buffers of the units reduce-scattered once per dtype (see the module's Note)."""
    slots: list[list[tuple[int, str]]] = [[] for _ in range(_NUM_SLOTS)]
    in_use: collections.Counter[tuple[int, str]] = collections.Counter()
    peak: collections.Counter[tuple[int, str]] = collections.Counter()
    for turn, index in enumerate(reduce_order(units)):
        slot = turn % _NUM_SLOTS
        in_use.subtract(slots[slot])
        keys = _split_keys(units[index], world=world, reduce_dtype=reduce_dtype)
        in_use.update(keys)
        for key in keys:
            peak[key] = max(peak[key], in_use[key])
        slots[slot] = keys if overlap else []
        if not overlap:
            in_use.subtract(keys)
    return sum(numel * DTYPE_BYTES[d] * count for (numel, d), count in peak.items())

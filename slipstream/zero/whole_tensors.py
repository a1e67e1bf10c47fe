"""Whole-tensor norms over shards: which part of which parameter each piece an optimizer steps holds.

[Note: whole-tensor map]
ZeRO hands the wrapped optimizer *pieces* (zero/flat_group.py, zero/stage3/group.py): flat fp32 tensors that
hold parts of several parameters, while one parameter may be cut across ranks (and, at stage 3, across runs).
An elementwise optimizer does not care. An optimizer whose update needs a parameter whole (LAMB's trust ratio
||w|| / ||u||, Muon's Newton-Schulz orthogonalisation of a matrix) asks for this map:
- `parts(piece)`: the `TensorPart`s in a piece: parameter number `tensor`, `numel` elements at `offset` in the
  flattened piece, which are elements [lo, lo + numel) of the flattened parameter;
- `sum_squares(values)`: per parameter, the sums of squares of one or more per-piece tensors (the weights and
  the update), over every rank: ONE all-reduce of a (parameters x columns) vector per call;
- `gather(tensors, values)`: the named parameters' values whole on every rank that holds a part of them (one
  all-reduce of a flat buffer, allocated once).
Parameters are numbered the same on every rank (the ZeRO optimizer's `trainable_params()` order).
`WholeTensorMap.of_params` is the map of plain parameters (no ZeRO: each piece is one whole parameter), and
`attach_whole_tensors` gives a ZeRO optimizer's map to a wrapped optimizer that asks for one
(`wants_whole_tensors`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol, cast

import torch
import torch.distributed as dist

from slipstream.comm import collectives
from slipstream.zero.slices import OwnedSlice

__all__ = ["TensorPart", "WholeTensorMap", "attach_whole_tensors"]


@dataclasses.dataclass(frozen=True, slots=True)
class TensorPart:
    """`numel` elements at `offset` of a piece: elements [lo, lo + numel) of flattened parameter `tensor`."""

    tensor: int
    offset: int
    numel: int
    lo: int


@dataclasses.dataclass(eq=False)
class WholeTensorMap:
    """See [Note: whole-tensor map]."""

    shapes: tuple[tuple[int, ...], ...]
    """Each parameter's shape, by parameter number."""
    group_of: tuple[int, ...]
    """Each parameter's param group (index into the optimizer's `param_groups`)."""
    parts_of: Mapping[int, tuple[TensorPart, ...]]
    """id(piece) -> the parameter parts in it."""
    split: frozenset[int]
    """Parameters no rank holds whole (the ones `gather` has to bring together)."""
    process_group: dist.ProcessGroup | None = None
    comm_device: torch.device | None = None
    """Where the collectives run (the parameters' device: with offload the pieces are host memory)."""
    sharded: bool = False
    """Parameters are cut across the ranks of `process_group`; False: every rank holds each one whole."""
    _buffers: dict[tuple[int, ...], torch.Tensor] = dataclasses.field(default_factory=dict)

    @classmethod
    def of_params(cls, param_groups: Sequence[Mapping[str, object]]) -> WholeTensorMap:
        """The map of plain parameters: each tensor an optimizer steps is one whole parameter."""
        shapes: list[tuple[int, ...]] = []
        group_of: list[int] = []
        parts: dict[int, tuple[TensorPart, ...]] = {}
        for number, group in enumerate(param_groups):
            for param in _tensors(group["params"]):
                parts[id(param)] = (TensorPart(tensor=len(shapes), offset=0, numel=param.numel(), lo=0),)
                shapes.append(tuple(param.shape))
                group_of.append(number)
        return cls(shapes=tuple(shapes), group_of=tuple(group_of), parts_of=parts, split=frozenset())

    def parts(self, piece: torch.Tensor) -> tuple[TensorPart, ...]:
        found = self.parts_of.get(id(piece))
        if found is None:
            raise RuntimeError(
                f"a tensor of shape {tuple(piece.shape)} stepped by the optimizer is not in its whole-tensor map: "
                "the optimizer's param groups changed after ZeRO wrapped it; add parameters before initialize()"
            )
        return found

    def sum_squares(self, values: Iterable[tuple[torch.Tensor, Sequence[torch.Tensor]]]) -> torch.Tensor:
        """(parameters x columns) float64: column c holds each parameter's sum of squares of the c-th tensor of
        every (piece, [tensors shaped like the piece]) in `values`, summed over the ranks (one all-reduce)."""
        rows: list[int] = []
        columns: list[list[torch.Tensor]] = []
        for piece, tensors in values:
            for part in self.parts(piece):
                rows.append(part.tensor)
                segments = [t.reshape(-1)[part.offset : part.offset + part.numel] for t in tensors]
                columns.append([_norm(x).double().square() for x in segments])
        local = torch.stack([torch.stack(c) for c in columns]) if columns else torch.zeros(0, 1, dtype=torch.float64)
        return self.total_sums(rows, local)

    def total_sums(self, rows: Sequence[int], local: torch.Tensor) -> torch.Tensor:
        """(parameters x columns) float64: row k of `local` (this rank's sums over one part) added into parameter
        `rows[k]`, summed over the ranks (one all-reduce)."""
        sums = torch.zeros(len(self.shapes), local.shape[1], dtype=torch.float64, device=self.comm_device)
        if len(rows):
            sums.index_add_(0, torch.tensor(rows, device=sums.device), local.to(sums.device, torch.float64))
        if self.sharded:
            collectives.all_reduce(sums, group=self.process_group)
        return sums

    def gather(self, tensors: Sequence[int], values: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """The parameters numbered `tensors` (the same list on every rank) whole, from each rank's parts of them
        in `values` ((piece, a tensor shaped like it)): one all-reduce of a flat buffer reused across steps."""
        offsets, total = {}, 0
        for number in tensors:
            offsets[number] = total
            total += math.prod(self.shapes[number])
        pairs = list(values)
        key = tuple(tensors)
        buffer = self._buffers.get(key)
        if buffer is None:
            buffer = self._buffers[key] = torch.zeros(total, dtype=torch.float32, device=self.comm_device)
        buffer.zero_()
        for piece, value in pairs:
            for part in self.parts(piece):
                if part.tensor in offsets:
                    start = offsets[part.tensor] + part.lo
                    buffer[start : start + part.numel].copy_(value.reshape(-1)[part.offset : part.offset + part.numel])
        if self.sharded and tensors:
            collectives.all_reduce(buffer, group=self.process_group)
        return [buffer[offsets[n] : offsets[n] + math.prod(self.shapes[n])].view(self.shapes[n]) for n in tensors]


def _norm(x: torch.Tensor) -> torch.Tensor:
    """The 2-norm of `x`, computed in fp32 at least (no wider copy of `x`)."""
    return torch.linalg.vector_norm(x, dtype=torch.promote_types(x.dtype, torch.float32))


def _tensors(params: object) -> list[torch.Tensor]:
    return [p for p in params if isinstance(p, torch.Tensor)] if isinstance(params, Iterable) else []


class _Attaches(Protocol):
    def attach_whole_tensors(self, whole: WholeTensorMap) -> None: ...


class _ZeroOptimizer(Protocol):
    optimizer: torch.optim.Optimizer
    owns_all: bool
    world_size: int
    process_group: dist.ProcessGroup | None
    groups: list[object]

    def trainable_params(self) -> list[torch.Tensor]: ...

    def owned_slices(self, names: dict[int, str], *, for_save: bool, only: str | None = None) -> list[OwnedSlice]: ...

    def _other_groups(self) -> bool: ...


def _group_params(group: object) -> list[torch.Tensor]:
    """The parameters of one ZeRO param group: `params` at stages 0-2, its runs' parameters at stage 3."""
    params = getattr(group, "params", None)
    if params is not None:
        return list(params)
    return [run.unit.params[i] for run in getattr(group, "runs", ()) for i in run.indices]


def attach_whole_tensors(zero: _ZeroOptimizer, offload_in_files: bool) -> None:
    """Give `zero.optimizer` its whole-tensor map when it asks for one (`wants_whole_tensors`); a collective
    (one small all-reduce finds the parameters no rank holds whole) that every rank makes at the same point."""
    if not getattr(type(zero.optimizer), "wants_whole_tensors", False):
        return
    name = type(zero.optimizer).__name__
    if offload_in_files:
        raise ValueError(
            f"{name} needs each parameter's whole-tensor norms in one step, but offload_optimizer.device 'nvme' "
            "steps one sub-group at a time with the rest in files; use offload_optimizer.device 'cpu'"
        )
    if zero._other_groups():
        raise ValueError(
            f"{name} with param groups reduced over other process groups (MoE experts) is not supported; use "
            "AdamW for a model with experts"
        )
    params = zero.trainable_params()
    number = {id(p): i for i, p in enumerate(params)}
    group_of = [0] * len(params)
    for index, group in enumerate(zero.groups):
        for param in _group_params(group):
            group_of[number[id(param)]] = index
    names = {id(p): str(i) for i, p in enumerate(params)}
    parts: dict[int, list[TensorPart]] = {}
    device = getattr(zero.groups[0], "device", None) if zero.groups else None
    held = torch.zeros(len(params), dtype=torch.int64)
    for piece in zero.owned_slices(names, for_save=False):
        if piece.piece is None:
            continue
        tensor = int(piece.name)
        held[tensor] += piece.hi - piece.lo
        part = TensorPart(tensor=tensor, offset=piece.piece_offset, numel=piece.hi - piece.lo, lo=piece.lo)
        parts.setdefault(id(piece.piece), []).append(part)
    shapes = tuple(tuple(p.shape) for p in params)
    sharded = not zero.owns_all and zero.world_size > 1
    whole = (held == torch.tensor([math.prod(s) for s in shapes], dtype=torch.int64)).to(torch.int64).to(device)
    if sharded:
        collectives.all_reduce(whole, group=zero.process_group, op=dist.ReduceOp.MAX)
    cast(_Attaches, zero.optimizer).attach_whole_tensors(
        WholeTensorMap(
            shapes=shapes,
            group_of=tuple(group_of),
            parts_of={key: tuple(value) for key, value in parts.items()},
            split=frozenset(i for i, held_whole in enumerate(whole.tolist()) if not held_whole),
            process_group=zero.process_group,
            comm_device=device,
            sharded=sharded,
        )
    )

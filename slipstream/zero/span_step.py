"""`SpanStep`: phases 3 and 4 of stages 1 and 2 taken span by span, so that the gather of one span's updated
pieces runs while the optimizer updates the next.

[Note: overlapped gather of the updated pieces]
Stages 1 and 2 update this rank's pieces and then gather every rank's ([Note: gathering the pieces] in
flat_group.py). Done one after the other, the gather is a phase of its own at the end of every step, as long as
the all-reduce DDP hides in backward. Here each param group's buckets are cut into spans of consecutive buckets
of at least `SPAN_BYTES` of parameters (a group smaller than that is one span), and the schedule is:
    for each span, in layout order:
        Phase 3: the wrapped optimizer updates the span's master pieces (`step_pieces`, its param group cut
                 down to them) and their new values are cast into the flat params
        Phase 4: the span's gather is launched asynchronously (on the device on the communication stream,
                 [Note: the communication stream] in comm_stream.py, which waits for the update first)
    then every gather is waited for, and the current stream joins the communication stream.
So `step()` still returns with every parameter complete. The update of an element depends on that element
alone and on per-parameter state (the optimizers in `PIECEWISE`, stepped exactly as a whole-group step would),
and a span's gather writes only the other ranks' pieces of its own buckets, which no later update reads: the
parameters and the optimizer state are bit for bit those of the step taken whole. Anything else steps whole,
then gathers: another optimizer (per-tensor math such as LAMB's, a step count kept per param group, the 1-bit
optimizers' own communication), offload_optimizer (its policy runs the step on the host), stochastic rounding
(it draws its noise piece by piece itself), an optimizer with step hooks (`register_step_pre_hook` /
`register_step_post_hook`, its own or torch's global ones: they would run once per span).
"""

from __future__ import annotations

from typing import Protocol

import torch

from slipstream.comm.collectives import TimedWork
from slipstream.offload.policy import OffloadPolicy
from slipstream.ops.adam.fused_adam import FusedAdam
from slipstream.precision.masters import NearestRounding
from slipstream.zero.comm_stream import CommStream
from slipstream.zero.flat_group import FlatGroup
from slipstream.zero.layout import GroupLayout

SPAN_BYTES = 32 * 2**20
"""The least parameter bytes of a span (the last of a group may be smaller); each span costs one gather."""

PIECEWISE: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, FusedAdam)
"""Optimizer classes (exactly these, not subclasses) whose step over some pieces equals their part of a step
over all: elementwise updates, every state (the step count included) kept per parameter."""


class SteppedInSpans(Protocol):
    """What `SpanStep` needs of the ZeRO optimizer (zero/optimizer.py, zero/sub_group_step.py)."""

    optimizer: torch.optim.Optimizer
    master_rounding: NearestRounding
    offload: OffloadPolicy
    groups: list[FlatGroup]
    _low_precision_out: list[torch.Tensor]

    def step_pieces(self, number: int, start: int, end: int) -> None: ...


def _has_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    """Step hooks registered on the optimizer or for all optimizers: a span step would call them once per span."""
    from torch.optim import optimizer as torch_optimizer

    own = [getattr(optimizer, name, None) for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")]
    shared = [
        getattr(torch_optimizer, name, None) for name in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")
    ]
    return any(bool(hooks) for hooks in own + shared)


def bucket_spans(layout: GroupLayout, span_numel: int) -> list[tuple[int, int]]:
    """[first, end) bucket ranges of `layout`, in order, each of at least `span_numel` padded elements but the
    last."""
    spans, first, numel = [], 0, 0
    for index, bucket in enumerate(layout.buckets):
        numel += bucket.padded_numel
        if numel >= span_numel:
            spans.append((first, index + 1))
            first, numel = index + 1, 0
    if first < len(layout.buckets):
        spans.append((first, len(layout.buckets)))
    return spans


class SpanStep:
    """The span schedule of [Note: overlapped gather of the updated pieces] over the flat groups of one
    optimizer; `comm` is the engine's communication stream."""

    def __init__(self, groups: list[FlatGroup], *, comm: CommStream, span_bytes: int = SPAN_BYTES) -> None:
        self.groups = groups
        self.comm = comm
        self.spans = [
            bucket_spans(flat.layout, max(1, span_bytes // flat.flat_params.element_size())) for flat in groups
        ]

    @classmethod
    def for_optimizer(cls, zero: SteppedInSpans, *, comm: CommStream) -> SpanStep | None:
        """The span schedule of `zero`'s groups where it applies (see the note), else None: step whole, then
        gather."""
        if type(zero.optimizer) not in PIECEWISE or type(zero.master_rounding) is not NearestRounding:
            return None
        if zero.offload.on_host or zero._low_precision_out or _has_step_hooks(zero.optimizer):
            return None
        return cls(zero.groups, comm=comm)

    def run(self, optimizer: SteppedInSpans) -> None:
        """Phases 3 and 4, span by span; returns once every gather is complete."""
        works: list[TimedWork] = []
        for number, (flat, spans) in enumerate(zip(self.groups, self.spans)):
            for first, end in spans:
                optimizer.step_pieces(number, first, end)
                if flat.world_size > 1:
                    works += flat.start_gather(first, end, self.comm)
        for work in works:
            work.wait()
        self.comm.join()

"""Pruning and ranking before any trial runs.

[Note: the pruning rule]
A candidate is skipped only when it cannot fit: when even its planner figure less the margin is above the
budget (`needed * (1 - margin) > budget`). `needed` is the planner's model states (estimates.py; what
`owned_bytes()` counts, predicted within 5% by tests/dist/planner) plus the activations the profile run measured,
so with a margin above the planner's error no candidate that fits is ever skipped; one predicted above the
budget but within the margin is kept and ranked after every candidate predicted to fit, and its trial says
whether it does. On the CPU device and host memory are one, so a rank needs its device and host figures
together; elsewhere the device figure meets the device budget and the host figure of every local rank meets the
host's memory.

[Note: the throughput estimate]
Candidates that fit are ranked by samples per second estimated from the model's profile (throughput.py, [Note:
the profiled estimate]); where the profile run took no profile, by the fixed cost model here: a relative estimate of samples per second, not a prediction of seconds:
a larger micro batch amortises the per-step overhead (`micro / (micro + OVERHEAD_SAMPLES)`), a higher ZeRO
stage costs more communication, optimizer offload moves the optimizer step to the host, parameter offload fetches every parameter from it
(`PARAM_OFFLOAD_COST`) and activation checkpointing
recomputes the forward (`STAGE_COST`, `OFFLOAD_COST`, `RECOMPUTE_COST`: a backward is about two forwards, so one
more forward adds a third). The trials measure; the estimate only decides which few run (and `model_based`
corrects it as they do, order.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from slipstream.autotuning.estimates import Figures
from slipstream.autotuning.space import Candidate

__all__ = ["DEFAULT_MARGIN", "Ranked", "estimated_throughput", "needed_bytes", "rank"]

DEFAULT_MARGIN = 0.10
"""Planner error tolerated before a candidate is called unable to fit (see [Note: the pruning rule])."""
OVERHEAD_SAMPLES = 2.0
STAGE_COST = {0: 1.0, 1: 1.05, 2: 1.1, 3: 1.3}
OFFLOAD_COST = 1.6
RECOMPUTE_COST = 4 / 3
PARAM_OFFLOAD_COST = 2.0


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Ranked:
    """A candidate with its figures and the verdict."""

    candidate: Candidate
    needed: int
    """Bytes per rank held against the budget."""
    estimate: float
    """Relative throughput (see [Note: the throughput estimate])."""
    skipped: str
    """Why it cannot fit ("" when kept)."""
    within_budget: bool
    """Predicted to fit without the margin."""


def needed_bytes(figures: Figures, *, device_is_host: bool) -> int:
    """What one rank needs of the budgeted memory (see [Note: the pruning rule])."""
    device = figures.device + (figures.activations or 0)
    return device + figures.host if device_is_host else device


def estimated_throughput(candidate: Candidate) -> float:
    """The fixed cost model's relative throughput (see [Note: the throughput estimate])."""
    micro = candidate.micro_batch
    cost = STAGE_COST[candidate.stage] * (OFFLOAD_COST if candidate.offload_optimizer else 1.0)
    cost *= RECOMPUTE_COST if candidate.activation_checkpointing else 1.0
    cost *= PARAM_OFFLOAD_COST if candidate.offload_param else 1.0
    return micro / (micro + OVERHEAD_SAMPLES) / cost


def _verdict(
    figures: Figures, *, budget: int, host_budget: int | None, ranks_per_node: int, margin: float, is_host: bool
) -> tuple[int, str, bool]:
    needed = needed_bytes(figures, device_is_host=is_host)
    if needed * (1.0 - margin) > budget:
        return needed, f"needs {needed:,} B per rank, over the budget of {budget:,} B", False
    host = figures.host * ranks_per_node
    if not is_host and host_budget is not None and host * (1.0 - margin) > host_budget:
        return needed, f"needs {host:,} B of host memory per node, over {host_budget:,} B", False
    return needed, "", needed <= budget and (is_host or host_budget is None or host <= host_budget)


def rank(
    candidates: list[Candidate],
    figures: dict[str, Figures],
    *,
    budget: int,
    host_budget: int | None,
    ranks_per_node: int,
    num_micro_batches: int,
    margin: float = DEFAULT_MARGIN,
    device_is_host: bool,
    estimate: Callable[[Candidate], float] = estimated_throughput,
) -> list[Ranked]:
    """Every candidate with its verdict: the kept ones first, best estimate first (those predicted within the
    budget before those kept only by the margin), then the skipped. Per stage, offload, bucket size and checkpointing only the
    `num_micro_batches` largest micro batches that are kept stay kept."""
    judged = []
    for candidate in candidates:
        needed, skipped, within = _verdict(
            figures[candidate.name],
            budget=budget,
            host_budget=host_budget,
            ranks_per_node=ranks_per_node,
            margin=margin,
            is_host=device_is_host,
        )
        judged.append(
            Ranked(
                candidate=candidate,
                needed=needed,
                estimate=estimate(candidate),
                skipped=skipped,
                within_budget=within,
            )
        )
    judged = _keep_largest_micro_batches(judged, num_micro_batches)
    return sorted(judged, key=lambda r: (bool(r.skipped), not r.within_budget, -r.estimate, r.candidate.name))


def _keep_largest_micro_batches(judged: list[Ranked], count: int) -> list[Ranked]:
    """Mark all but the `count` largest kept micro batches of each stage / offload / bucket / checkpointing family as skipped."""
    seen: dict[Candidate, int] = {}
    out = []
    for item in sorted(judged, key=lambda r: -r.candidate.micro_batch):
        family = dataclasses.replace(item.candidate, micro_batch=0, grad_accum=0)  # every other dimension
        if not item.skipped:
            seen[family] = seen.get(family, 0) + 1
            if seen[family] > count:
                item = dataclasses.replace(item, skipped=f"beyond the {count} largest micro batches that fit")
        out.append(item)
    return out

"""The settings sweep of `slipstream nvme tune` (DeepSpeed's ds_nvme_tune): which `aio` settings move data
fastest in a directory, within a time budget, and whether they beat the defaults at all.

[Note: how the tuner decides]
A cycle is one write then one read of `size` bytes with one settings (bench.py): what NVMe offload does to
a swap file every step. Screening: every candidate (the grid, the defaults first) gets one cycle per round,
visited in an order rotated from round to round so load from other processes does not always hit the same
ones; rounds go on while `screen_share` of the budget lasts (at most `max_rounds`). A candidate's figure is
its median cycle. Confirmation: the fastest candidate and the defaults are measured in adjacent pairs, the
order alternating, until the budget is spent (at least MIN_PAIRS; MAX_PAIRS only bounds a huge budget). The tuned settings
beat the defaults only if they were faster in so many pairs that a fair coin would do as well less than
1% of the time (a one-sided sign test) and their median cycle is at least MIN_GAIN faster; otherwise the
defaults are already best and are what the tuner recommends. The screening's winner is the best of many
noisy figures, so its screening figure flatters it; the confirmation's fresh pairs do not.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from slipstream.ops.aio.bench import AioSettings, IoBench, describe

MIN_PAIRS = 8
MAX_PAIRS = 500
MIN_GAIN = 0.05
SIGNIFICANCE = 0.01


@dataclasses.dataclass
class Candidate:
    """One settings and its screening cycles (seconds of each write and read)."""

    settings: AioSettings
    write_s: list[float] = dataclasses.field(default_factory=list)
    read_s: list[float] = dataclasses.field(default_factory=list)

    @property
    def cycle_s(self) -> float:
        """Median seconds of a write + read cycle (inf before the first)."""
        return statistics.median(w + r for w, r in zip(self.write_s, self.read_s)) if self.write_s else math.inf

    def rates(self, size: int) -> dict[str, float]:
        """GB/s of the median write, the median read and the median cycle (2 x size moved)."""
        if not self.write_s:
            return {"write_gb_s": math.nan, "read_gb_s": math.nan, "cycle_gb_s": math.nan}
        return {
            "write_gb_s": size / statistics.median(self.write_s) / 1e9,
            "read_gb_s": size / statistics.median(self.read_s) / 1e9,
            "cycle_gb_s": 2 * size / self.cycle_s / 1e9,
        }


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Whether the tuned settings beat the defaults, on the confirmation pairs; `recommended` is what to use."""

    tuned_beats_defaults: bool
    recommended: AioSettings
    pairs: int
    faster_pairs: int
    median_gain: float
    p_value: float
    text: str


@dataclasses.dataclass(frozen=True)
class TuneReport:
    size: int
    budget_s: float
    spent_s: float
    rounds: int
    defaults: AioSettings
    candidates: list[Candidate]
    """Fastest first; those the budget left unmeasured last."""
    verdict: Verdict


def grid(
    defaults: AioSettings,
    *,
    block_sizes: Sequence[int],
    queue_depths: Sequence[int],
    parallelisms: Sequence[int],
    overlap_events: Sequence[bool],
) -> list[AioSettings]:
    """Every combination (single_submit as in the defaults), the defaults first and once. `defaults` is a
    frozen dataclass (the plan's AioPlan), so its variations are too."""
    base: Any = defaults
    combos = [
        dataclasses.replace(base, block_size=b, queue_depth=q, intra_op_parallelism=p, overlap_events=o)
        for b, q, p, o in itertools.product(block_sizes, queue_depths, parallelisms, overlap_events)
    ]
    return list(dict.fromkeys([defaults, *combos]))


def sign_test_p(faster: int, pairs: int) -> float:
    """P(at least `faster` heads in `pairs` fair coin flips): how often chance alone does as well."""
    return sum(math.comb(pairs, k) for k in range(faster, pairs + 1)) / 2**pairs


def decide(defaults: AioSettings, best: AioSettings, pairs: Sequence[tuple[float, float]]) -> Verdict:
    """`pairs` are (defaults' cycle, best's cycle) seconds, measured back to back; see the module doc."""
    if best == defaults or not pairs:
        return Verdict(
            False, defaults, 0, 0, 0.0, 1.0, "the defaults are already best: no other settings was faster in the sweep"
        )
    faster = sum(1 for d, b in pairs if b < d)
    gain = statistics.median(d / b for d, b in pairs) - 1
    p = sign_test_p(faster, len(pairs))
    evidence = (
        f"faster in {faster} of {len(pairs)} back-to-back pairs (chance alone: p = {p:.2g}), median cycle {gain:+.1%}"
    )
    if p < SIGNIFICANCE and gain >= MIN_GAIN:
        return Verdict(True, best, len(pairs), faster, gain, p, f"the tuned settings beat the defaults: {evidence}")
    return Verdict(
        False,
        defaults,
        len(pairs),
        faster,
        gain,
        p,
        f"the defaults are already best: the sweep's fastest ({describe(best)}) was {evidence}, not "
        f"a clear win (needs p < {SIGNIFICANCE:g} and at least {MIN_GAIN:.0%})",
    )


def _cycle(bench: IoBench, settings: AioSettings, size: int) -> tuple[float, float]:
    return bench.transfer(settings, size, "write"), bench.transfer(settings, size, "read")


def _screen(
    bench: IoBench, candidates: list[Candidate], size: int, *, until: float, max_rounds: int, clock: Callable[[], float]
) -> int:
    """Screening rounds until the clock passes `until` (the defaults, first, are always measured once);
    returns the rounds begun. Candidates the budget did not reach keep no cycles."""
    rounds = 0
    while rounds < max_rounds and (rounds == 0 or clock() < until):
        shift = rounds * max(1, len(candidates) // max_rounds)
        for i, candidate in enumerate(candidates[shift:] + candidates[:shift]):
            if clock() >= until and not (rounds == 0 and i == 0):
                break
            write, read = _cycle(bench, candidate.settings, size)
            candidate.write_s.append(write)
            candidate.read_s.append(read)
        rounds += 1
    return rounds


def _confirm(
    bench: IoBench, defaults: AioSettings, best: AioSettings, size: int, *, until: float, clock: Callable[[], float]
) -> list[tuple[float, float]]:
    pairs: list[tuple[float, float]] = []
    while len(pairs) < MAX_PAIRS and (len(pairs) < MIN_PAIRS or clock() < until):
        if len(pairs) % 2 == 0:
            ours, theirs = sum(_cycle(bench, defaults, size)), sum(_cycle(bench, best, size))
        else:
            theirs = sum(_cycle(bench, best, size))
            ours = sum(_cycle(bench, defaults, size))
        pairs.append((ours, theirs))
    return pairs


def tune(
    bench: IoBench,
    defaults: AioSettings,
    settings: Sequence[AioSettings],
    size: int,
    budget_s: float,
    *,
    screen_share: float = 0.6,
    max_rounds: int = 3,
    clock: Callable[[], float] = time.monotonic,
) -> TuneReport:
    """Sweep `settings` (which should hold the defaults) on `bench` within about `budget_s` seconds."""
    start = clock()
    candidates = [Candidate(s) for s in dict.fromkeys([defaults, *settings])]
    rounds = _screen(bench, candidates, size, until=start + screen_share * budget_s, max_rounds=max_rounds, clock=clock)
    ranked = sorted(candidates, key=lambda c: c.cycle_s)
    best = ranked[0].settings
    pairs = [] if best == defaults else _confirm(bench, defaults, best, size, until=start + budget_s, clock=clock)
    return TuneReport(
        size=size,
        budget_s=budget_s,
        spent_s=clock() - start,
        rounds=rounds,
        defaults=defaults,
        candidates=ranked,
        verdict=decide(defaults, best, pairs),
    )

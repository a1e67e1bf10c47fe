"""Graph breaks per compiled region, read from dynamo's own counters, and the one report of them.

dynamo counts every graph break in `torch._dynamo.utils.counters["graph_break"]` (reason -> count), for the
whole process. The ledger reads that counter before and after each call of a compiled region, so each break
is charged to the region whose call compiled it (a break is counted when its frame is compiled, that is on
the first call and on recompiles). Once every region has run, rank 0 logs the total, with the regions and
the reasons, once.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator

from torch._dynamo.utils import counters

from slipstream.utils.logging import log_rank0


def _breaks_now() -> collections.Counter[str]:
    return collections.Counter(counters["graph_break"])


def _first_line(reason: str) -> str:
    return reason.strip().splitlines()[0] if reason.strip() else "(no reason given)"


class GraphBreakLedger:
    """Graph breaks charged to each compiled region by name."""

    def __init__(self, regions: list[str], *, rank: int) -> None:
        self.breaks: dict[str, collections.Counter[str]] = {name: collections.Counter() for name in regions}
        self._unseen = set(regions)
        self._rank = rank
        self._depth = 0
        self.reported = False

    @contextlib.contextmanager
    def watch(self, region: str) -> Iterator[None]:
        """Charge the graph breaks counted while this region runs to it (a region called from inside another
        region's call is charged with it)."""
        self._depth += 1
        before = _breaks_now() if self._depth == 1 else None
        try:
            yield
        finally:
            self._depth -= 1
            if before is not None:
                self.breaks[region].update(_breaks_now() - before)
                self._unseen.discard(region)
                if not self._unseen and not self.reported:
                    self.reported = True
                    log_rank0(self.summary(), rank=self._rank)

    def total(self) -> int:
        return sum(sum(reasons.values()) for reasons in self.breaks.values())

    def summary(self) -> str:
        """One line per region with breaks (its reasons' first lines); one line in all when there are none."""
        total = self.total()
        head = f"engine.compile(): {len(self.breaks)} compiled regions, {total} graph breaks"
        if total == 0:
            return head
        lines = [head + " (each splits a region's graph; fix them in the model's code):"]
        for region, reasons in self.breaks.items():
            for reason, count in reasons.items():
                lines.append(f"  {region}: {count} x {_first_line(reason)}")
        return "\n".join(lines)

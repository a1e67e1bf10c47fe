"""One curriculum metric's index, and which samples it makes eligible between two difficulties.

The data analyzer writes, per metric, `<metric>_index_to_sample` (row i: the samples whose metric has the i-th
smallest value, or a merged group of such rows) and `<metric>_index_to_metric` (row i: that value). Between a
previous difficulty and the current one a metric adds:
- difficulty_type "value": the samples of every row whose value v has previous < v <= current (previous None:
  no lower bound);
- difficulty_type "percentile": the samples at positions [per * previous, per * current) of the rows laid end
  to end, where per = total samples // max_difficulty (the end is every sample once current is the maximum).
Rows are taken in index order, each row's samples in file order (the sampler shuffles them afterwards).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from slipstream.config.data_plans import MetricPlan
from slipstream.data.indexed_dataset import IndexedDataset

__all__ = ["MetricIndex"]

Samples = npt.NDArray[np.int64]


class MetricIndex:
    """A metric's index files, opened (memory-mapped) once; None paths for a single-cluster metric."""

    def __init__(self, plan: MetricPlan) -> None:
        self.plan = plan
        self.rows: IndexedDataset | None = None
        self.values: npt.NDArray[np.int64] | None = None
        if plan.index_to_sample_path is not None:
            self.rows = IndexedDataset(plan.index_to_sample_path)
            self.total = int(np.sum(self.rows.sizes, dtype=np.int64))
        if self.rows is not None and plan.difficulty_type == "value":
            assert plan.index_to_metric_path is not None  # data_plans requires it
            metric = IndexedDataset(plan.index_to_metric_path)
            if len(metric) != len(self.rows):
                raise ValueError(
                    f"curriculum metric {plan.name!r}: {plan.index_to_metric_path} has {len(metric)} rows but "
                    f"{plan.index_to_sample_path} has {len(self.rows)}; give the two files of one analyzer run"
                )
            self.values = np.array([int(metric[row][0]) for row in range(len(metric))], dtype=np.int64)

    @property
    def restricts(self) -> bool:
        """False for a single-cluster metric (every sample is eligible whatever its difficulty)."""
        return self.rows is not None

    def start(self) -> int | None:
        """The previous difficulty before the first step: no lower bound (value) or 0 (percentile)."""
        return None if self.plan.difficulty_type == "value" else 0

    def eligible(self, previous: int | None, current: int) -> Samples:
        """The samples this metric adds when its difficulty moves from `previous` to `current`."""
        if self.plan.difficulty_type == "value":
            return self._by_value(previous, current)
        return self._by_percentile(previous or 0, current)

    def _by_value(self, previous: int | None, current: int) -> Samples:
        assert self.rows is not None and self.values is not None
        keep = self.values <= current
        if previous is not None:
            keep &= self.values > previous
        parts = [self.rows[int(row)] for row in np.flatnonzero(keep)]
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)

    def _by_percentile(self, previous: int, current: int) -> Samples:
        assert self.rows is not None
        per = self.total // self.plan.schedule.max_difficulty
        begin, end = per * previous, per * current
        if current == self.plan.schedule.max_difficulty:
            end = self.total
        parts, seen = [], 0
        for row in range(len(self.rows)):
            size = int(self.rows.sizes[row])
            if seen + size > begin and seen < end:
                parts.append(self.rows[row][max(0, begin - seen) : min(size, end - seen)])
            seen += size
            if seen >= end:
                break
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)

"""The data analyzer: its index files, read back, equal the metrics computed directly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from slipstream.data.analyzer import MetricAnalyzer
from slipstream.data.indexed_dataset import IndexedDataset

LENGTHS = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6]  # 23 samples: uneven splits


class _Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return len(LENGTHS)

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([LENGTHS[index], index % 3])


def _seqlen(batch: torch.Tensor) -> torch.Tensor:
    return batch[:, 0].to(torch.int64)


def _histogram(batch: torch.Tensor) -> torch.Tensor:
    return torch.bincount(batch[:, 1], minlength=3).to(torch.int64)


def test_analyzer_files_equal_the_metrics(tmp_path: Path) -> None:
    for worker in (0, 1):  # two map workers of two threads each, then the reduce
        analyzer = MetricAnalyzer(_Tokens(), num_workers=2, worker_id=worker, num_threads=2, batch_size=3,
                                  metric_names=["seqlen", "mod3"], metric_functions=[_seqlen, _histogram],
                                  metric_types=["single_value_per_sample", "accumulate_value_over_samples"],
                                  metric_dtypes=[torch.int64, torch.int64], save_path=str(tmp_path))
        analyzer.run_map()
    analyzer.run_reduce()
    folder = tmp_path / "seqlen"
    values = sorted(set(LENGTHS))
    to_sample = IndexedDataset(str(folder / "seqlen_index_to_sample"))
    to_metric = IndexedDataset(str(folder / "seqlen_index_to_metric"))
    assert [int(row[0]) for row in to_metric] == values
    assert [row.tolist() for row in to_sample] == [
        [i for i, length in enumerate(LENGTHS) if length == value] for value in values
    ]
    assert [int(row[0]) for row in IndexedDataset(str(folder / "seqlen_sample_to_metric"))] == LENGTHS
    assert to_sample.dtype == np.uint8 and to_metric.dtype == np.uint8  # the narrowest dtypes
    merged = IndexedDataset(str(folder / "seqlen_index_to_sample_percentile_merged"))
    assert np.concatenate(list(merged)).tolist() == np.concatenate(list(to_sample)).tolist()
    total = IndexedDataset(str(tmp_path / "mod3" / "mod3_metric_value"))[0]
    assert total.tolist() == [sum(1 for i in range(len(LENGTHS)) if i % 3 == k) for k in range(3)]

"""Metric indexes cross between DeepSpeed's data analyzer and ours (peer environment only: DeepSpeed is never a
dependency): an index DeepSpeed builds reads here as the metrics computed directly, and one built here reads
in DeepSpeed's MMapIndexedDataset the same way."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from slipstream.data.analyzer import MetricAnalyzer
from slipstream.data.indexed_dataset import IndexedDataset

LENGTHS = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 300]  # 300: a uint16 value
VALUES = sorted(set(LENGTHS))
ROWS = [[i for i, length in enumerate(LENGTHS) if length == value] for value in VALUES]


def _peer(args: list[str], cwd: Path) -> None:
    peer = os.environ.get("SLIPSTREAM_PEER_PYTHON") or str(Path(__file__).resolve().parents[2] / ".bench-venv/bin/python")
    if not Path(peer).is_file():
        pytest.skip("DeepSpeed peer environment absent (the comparison needs real DeepSpeed)")
    script = Path(__file__).parent / "peer" / "data_index_in_deepspeed.py"
    done = subprocess.run([peer, str(script), *args], capture_output=True, text=True, timeout=600, cwd=cwd)
    if done.returncode != 0 and "No module named 'deepspeed'" in done.stderr:
        pytest.skip("the peer interpreter has no DeepSpeed")
    assert done.returncode == 0, done.stderr[-4000:]


class _Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return len(LENGTHS)

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([LENGTHS[index], index % 3])


def test_index_built_by_deepspeed_reads_here_and_ours_reads_there(tmp_path: Path) -> None:
    (tmp_path / "lengths.json").write_text(json.dumps(LENGTHS))
    theirs, ours = tmp_path / "theirs", tmp_path / "ours"
    analyzer = MetricAnalyzer(_Tokens(), batch_size=3, metric_names=["seqlen"],
                              metric_functions=[lambda batch: batch[:, 0].to(torch.int64)],
                              metric_types=["single_value_per_sample"], metric_dtypes=[torch.int64],
                              save_path=str(ours))
    analyzer.run_map()
    analyzer.run_reduce()
    names = ("index_to_sample", "index_to_metric", "sample_to_metric", "index_to_sample_percentile_merged")
    reads: list[str] = []
    for name in names:
        reads += [str(ours / "seqlen" / f"seqlen_{name}"), str(tmp_path / f"{name}.json")]
    _peer(["build", "lengths.json", str(theirs)], tmp_path)
    _peer(["read", *reads], tmp_path)
    expected = {"index_to_sample": ROWS, "index_to_metric": [[v] for v in VALUES],
                "sample_to_metric": [[v] for v in LENGTHS], "index_to_sample_percentile_merged": ROWS}
    for name in names:
        mine = IndexedDataset(str(theirs / "seqlen" / f"seqlen_{name}"))  # DeepSpeed's files, read here
        assert [row.tolist() for row in mine] == expected[name], name
        there = json.loads((tmp_path / f"{name}.json").read_text())  # our files, read by DeepSpeed
        assert there["rows"] == expected[name], name
        assert there["dtype"] == mine.dtype.name, name  # the same narrowest dtypes

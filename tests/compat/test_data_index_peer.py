"""DeepSpeed's data efficiency and ours side by side (peer environment only: DeepSpeed is never a dependency):
an index DeepSpeed's analyzer builds reads here as the metrics computed directly, one built here reads the
same in DeepSpeed's MMapIndexedDataset, the curriculum sampler draws DeepSpeed's sampler's global batches
(one metric by value; a value and a percentile metric together), and dynamic batching packs the same groups
and scales the same rates as DeepSpeed's batch_by_seqlens and scale_lr."""

from __future__ import annotations

import copy
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from slipstream.compat.data_sampler import DeepSpeedDataSampler
from slipstream.compat.variable_batch_size_and_lr import batch_by_seqlens, scale_lr
from slipstream.data.analyzer import MetricAnalyzer
from slipstream.data.indexed_dataset import IndexedDataset, write_rows

LENGTHS = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 300]  # 300: a uint16 value
VALUES = sorted(set(LENGTHS))
ROWS = [[i for i, length in enumerate(LENGTHS) if length == value] for value in VALUES]
NAMES = ("index_to_sample", "index_to_metric", "sample_to_metric", "index_to_sample_percentile_merged")
EXPECTED = {"index_to_sample": ROWS, "index_to_metric": [[v] for v in VALUES],
            "sample_to_metric": [[v] for v in LENGTHS], "index_to_sample_percentile_merged": ROWS}
SAMPLE_ROWS = {1: [1, 3], 2: [6, 16], 3: [0, 9, 15, 17], 4: [2, 19], 5: [4, 8, 10], 6: [7], 7: [13], 8: [11, 18],
               9: [5, 12, 14]}  # 20 samples by value (tests/unit/data/test_curriculum_sampler.py's index)


def _peer(jobs: dict, cwd: Path) -> None:
    peer = os.environ.get("SLIPSTREAM_PEER_PYTHON") or str(Path(__file__).resolve().parents[2] / ".bench-venv/bin/python")
    if not Path(peer).is_file():
        pytest.skip("DeepSpeed peer environment absent (the comparison needs real DeepSpeed)")
    (cwd / "jobs.json").write_text(json.dumps(jobs))
    script = Path(__file__).parent / "peer" / "data_index_in_deepspeed.py"
    done = subprocess.run([peer, str(script), "jobs.json"], capture_output=True, text=True, timeout=600, cwd=cwd)
    if done.returncode != 0 and "No module named 'deepspeed'" in done.stderr:
        pytest.skip("the peer interpreter has no DeepSpeed")
    assert done.returncode == 0, done.stderr[-4000:]


class _Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return len(LENGTHS)

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([LENGTHS[index], index % 3])


def _sections(folder: Path) -> list[dict]:
    write_rows(str(folder / "m_index_to_sample"), list(SAMPLE_ROWS.values()), "uint8")
    write_rows(str(folder / "m_index_to_metric"), [[value] for value in SAMPLE_ROWS], "uint8")
    write_rows(str(folder / "p_index_to_sample"), [[i] for i in range(20)], "uint8")
    value = {"index_to_sample_path": str(folder / "m_index_to_sample"),
             "index_to_metric_path": str(folder / "m_index_to_metric"), "difficulty_type": "value",
             "clustering_type": "schedule_based", "min_difficulty": 2, "max_difficulty": 9,
             "schedule_type": "fixed_discrete", "schedule_config": {"difficulty": [2, 4, 9], "max_step": [2, 4]}}
    percentile = {"index_to_sample_path": str(folder / "p_index_to_sample"), "difficulty_type": "percentile",
                  "clustering_type": "schedule_based", "min_difficulty": 3, "max_difficulty": 10,
                  "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": 6, "difficulty_step": 1}}
    one = {"enabled": True, "seed": 1234, "data_sampling": {"enabled": True, "num_epochs": 10, "curriculum_learning": {
        "enabled": True, "data_cluster_path": str(folder / "clusters"), "curriculum_metrics": {"m": value}}}}
    two = copy.deepcopy(one)
    two["data_sampling"]["curriculum_learning"]["curriculum_metrics"]["p"] = percentile
    return [one, two]


def test_indexes_and_draws_match_deepspeed(tmp_path: Path) -> None:
    ours = tmp_path / "ours"
    analyzer = MetricAnalyzer(_Tokens(), batch_size=3, metric_names=["seqlen"],
                              metric_functions=[lambda batch: batch[:, 0].to(torch.int64)],
                              metric_types=["single_value_per_sample"], metric_dtypes=[torch.int64],
                              save_path=str(ours))
    analyzer.run_map()
    analyzer.run_reduce()
    sections = _sections(tmp_path)
    for number, section in enumerate(sections):
        (tmp_path / f"section{number}.json").write_text(json.dumps(section))
    _peer({"build": {"lengths": LENGTHS, "save_path": str(tmp_path / "theirs")},
           "read": [[str(ours / "seqlen" / f"seqlen_{name}"), f"{name}.json"] for name in NAMES],
           "sample": [[f"section{number}.json", 12, f"draws{number}.json"] for number in range(len(sections))]},
          tmp_path)
    for name in NAMES:
        mine = IndexedDataset(str(tmp_path / "theirs" / "seqlen" / f"seqlen_{name}"))  # DeepSpeed's files, here
        assert [row.tolist() for row in mine] == EXPECTED[name], name
        there = json.loads((tmp_path / f"{name}.json").read_text())  # our files, read by DeepSpeed
        assert there["rows"] == EXPECTED[name], name
        assert there["dtype"] == mine.dtype.name, name  # the same narrowest dtypes
    for number, section in enumerate(sections):
        sampler = DeepSpeedDataSampler(section, 20, 2, 0, 1, None, 2, 0)
        draws = [sampler.next_global_batch() for _ in range(12)]
        assert draws == json.loads((tmp_path / f"draws{number}.json").read_text()), f"section {number}"


# Dynamic batching: each case leaves DeepSpeed's last sample (in picking order) in a trimmed-off group, since
# DeepSpeed never packs that sample and Slipstream does (docs/data-sampling.md).
PACK_LENGTHS = [5, 3, 8, 2, 7, 4, 6, 1, 9, 3, 2, 5, 4, 8, 1, 6, 3, 7, 2, 4, 6, 2, 7]
PACKINGS = [
    {"max_tokens": 10, "effective_batch_size": 5},
    {"max_tokens": 10, "effective_batch_size": 5, "max_batch_size": 2},
    {"max_tokens": 12, "effective_batch_size": 5, "sequence_picking_order": "seqlen", "min_batch_size": 2},
    {"max_tokens": 10, "effective_batch_size": 4, "sequence_picking_order": "random", "seed": 7},
    {"max_tokens": 9, "effective_batch_size": 2, "sequence_picking_order": "random", "seed": 1234},
    {"max_tokens": 8, "effective_batch_size": 4, "sequence_ids_per_mb": list(range(0, 23, 2))},
]
SCALINGS = [[16, 12, 0.1, "linear"], [16, 25, 0.1, "sqrt"], [16, 3, 0.1, "none"]]


def test_dynamic_batching_matches_deepspeed(tmp_path: Path) -> None:
    _peer({"pack": {"lengths": PACK_LENGTHS, "packings": PACKINGS, "scalings": SCALINGS, "out": "packed.json"}},
          tmp_path)
    theirs = json.loads((tmp_path / "packed.json").read_text())
    ours = [batch_by_seqlens(PACK_LENGTHS, **kwargs) for kwargs in PACKINGS]
    assert [json.loads(json.dumps(packing)) for packing in ours] == theirs["packings"]
    assert [scale_lr(*args) for args in SCALINGS] == pytest.approx(theirs["scalings"])

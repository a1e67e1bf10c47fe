"""Dynamic batching's packing and LR scaling against DeepSpeed's (peer environment only: DeepSpeed is never a
dependency): the same groups, batch sizes and longest lengths for each picking order and limit, and the same
scaled rates. The cases keep DeepSpeed's last sample in a trimmed-off group: DeepSpeed never packs the last
sample in picking order, Slipstream does (docs/data-sampling.md)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from slipstream.compat.variable_batch_size_and_lr import batch_by_seqlens, scale_lr
from tests.compat.test_muon_peer import _peer_python

LENGTHS = [5, 3, 8, 2, 7, 4, 6, 1, 9, 3, 2, 5, 4, 8, 1, 6, 3, 7, 2, 4, 6, 2, 7]
PACKINGS = [
    {"max_tokens": 10, "effective_batch_size": 5},
    {"max_tokens": 10, "effective_batch_size": 5, "max_batch_size": 2},
    {"max_tokens": 12, "effective_batch_size": 5, "sequence_picking_order": "seqlen", "min_batch_size": 2},
    {"max_tokens": 10, "effective_batch_size": 4, "sequence_picking_order": "random", "seed": 7},
    {"max_tokens": 9, "effective_batch_size": 2, "sequence_picking_order": "random", "seed": 1234},
    {"max_tokens": 8, "effective_batch_size": 4, "sequence_ids_per_mb": [0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22]},
]
SCALINGS = [[16, 12, 0.1, "linear"], [16, 25, 0.1, "sqrt"], [16, 3, 0.1, "none"]]


def test_packing_and_scaling_match_deepspeed(tmp_path: Path) -> None:
    peer = _peer_python()
    if peer is None:
        pytest.skip("DeepSpeed peer environment absent (the comparison needs real DeepSpeed)")
    (tmp_path / "cases.json").write_text(json.dumps({"lengths": LENGTHS, "packings": PACKINGS, "scalings": SCALINGS}))
    script = Path(__file__).parent / "peer" / "variable_batch_in_deepspeed.py"
    done = subprocess.run([peer, str(script), "cases.json", "out.json"], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    if done.returncode != 0 and "No module named 'deepspeed'" in done.stderr:
        pytest.skip("the peer interpreter has no DeepSpeed")
    assert done.returncode == 0, done.stderr[-4000:]
    theirs = json.loads((tmp_path / "out.json").read_text())
    ours = [batch_by_seqlens(LENGTHS, **kwargs) for kwargs in PACKINGS]
    assert [json.loads(json.dumps(packing)) for packing in ours] == theirs["packings"]
    assert [scale_lr(*args) for args in SCALINGS] == pytest.approx(theirs["scalings"])

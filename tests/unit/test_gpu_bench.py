"""bench/gpu_train.py (run on a GPU by tools/gpu_bench.sh) checked on the CPU: its dry run trains every row on a
tiny model and writes both reports; a row past its timeout or without its framework is a status, not the end of
the run; MFU and the FLOP count follow their formulas. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_train  # noqa: E402
from _gpu_train_row import ROWS, flops_per_token  # noqa: E402


def test_dry_run_trains_every_row_and_writes_both_reports(tmp_path: Path) -> None:
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_train.py"), "--dry-run", "--in-process"]
    cmd += ["--frameworks", "slipstream", "--out", str(tmp_path)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_train.json").read_text())
    rows = report["rows"]
    assert [r["row"] for r in rows] == list(ROWS)
    for r in rows:
        if r["row"] == "zero3_compile" and r["status"] == "not available":
            continue
        assert r["status"] == "ok", r
        assert r["tokens_per_s"] > 0 and r["step_s"] == pytest.approx(
            r["forward_s"] + r["backward_s"] + r["optimizer_s"]
        )
        assert r["predicted"]["states"] > 0 and r["predicted"]["activations"] > 0
        # Same seed, same data, one step of the same model: every ZeRO configuration reaches the same loss.
        assert r["last_loss"] == pytest.approx(rows[0]["last_loss"], rel=1e-2)
    by_row = {r["row"]: r for r in rows}
    assert by_row["zero3_ckpt"]["predicted"]["activations"] < by_row["zero3"]["predicted"]["activations"]
    table = (tmp_path / "gpu_train.md").read_text()
    assert all(f"| {name} | slipstream" in table for name in ROWS)


def test_timeout_and_missing_peer_are_row_statuses(tmp_path: Path) -> None:
    args = gpu_train.parse_args(["--dry-run", "--peer-python", str(tmp_path / "no-python"), "--out", str(tmp_path)])
    timed_out = gpu_train.run_one(args, "slipstream", "zero0", timeout=0.5)
    assert timed_out["status"] == "timeout"
    assert gpu_train.run_one(args, "deepspeed", "zero0", timeout=30)["status"] == "not installed"


def test_unknown_row_is_refused_by_name() -> None:
    with pytest.raises(SystemExit):
        gpu_train.parse_args(["--rows", "zero0,zero4"])


def test_mfu_and_flops_per_token() -> None:
    spec = {"layers": 16, "width": 2048, "seq": 2048, "vocab": 32000}
    params = 1_000_000_000
    expected = 6 * (params - 32000 * 2048) + 12 * 16 * 2048 * 2048
    assert flops_per_token(params, spec) == expected
    result = {"device": "NVIDIA H100 80GB HBM3", "tokens_per_s": 10_000.0, "flops_per_token": expected}
    assert gpu_train.mfu(result) == pytest.approx(10_000.0 * expected / 989e12)
    assert gpu_train.mfu({**result, "device": "cpu"}) is None

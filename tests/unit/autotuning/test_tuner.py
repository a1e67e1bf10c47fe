"""The tuner's phases (autotuning/tuner.py) over a stand-in launcher (fake_launch.py): which candidates run, how a
failed trial is recorded without ending the tuning, early stopping, and the results written."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from slipstream.autotuning.results import write_results
from slipstream.autotuning.tuner import Job, tune
from tests.unit.autotuning.jobs import make_job

FAKE = Path(__file__).with_name("fake_launch.py")
RUNNER = Path(__file__).with_name("fake_runner.py")
USER = {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def _job(tmp_path: Path, *, budget: int, trials: int, session: bool = True, **tuning: object) -> Job:
    tuning = {
        "results_dir": str(tmp_path / "results"),
        "exps_dir": str(tmp_path / "exps"),
        "max_train_micro_batch_size_per_gpu": 8,
        **tuning,
    }
    launcher = [sys.executable, str(RUNNER)]
    return make_job(
        launcher, str(FAKE), USER, tuning, world=1, budget=budget, trials=trials, timeout_s=3.0, session=session
    )


def test_failures_are_recorded_and_the_tuning_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_TRIALS", json.dumps({"0": "fail", "1": "oom", "2": "hang", "3": 5.0}))
    outcome = tune(_job(tmp_path, budget=4500, trials=9, num_tuning_micro_batch_sizes=1))
    # 1000 B per sample: micro 8 (8000 B) cannot fit 4500 B even with the margin; micro 4 is the largest kept
    assert all(r.skipped for r in outcome.ranked if r.candidate.micro_batch == 8)
    # nothing the planner calls unable to fit (by more than the margin) is launched
    launched = {p.name for p in (tmp_path / "exps").iterdir()}
    assert not launched & {r.candidate.name for r in outcome.ranked if r.skipped}
    ran = [(t.ranked.candidate.name, t.error or t.metrics["throughput"]) for t in outcome.trials]  # type: ignore[index]
    assert ran[:4] == [
        ("z0_mbs4_gas2", "exit status 1: RuntimeError: fake trial failed"),
        ("z1_mbs4_gas2", "out of memory"),
        ("z2_mbs4_gas2", "timeout after 3 s"),
        ("z3_mbs4_gas2", 5.0),
    ]
    assert outcome.best is outcome.trials[3]
    optimal = write_results(outcome, results_dir=str(tmp_path / "results"), metric="throughput")
    assert optimal is not None and json.loads(optimal.read_text())["zero_optimization"] == {"stage": 3}
    if importlib.util.find_spec("matplotlib") is not None:  # the plot is optional (not a dependency)
        assert (tmp_path / "results" / "trials.png").stat().st_size > 0
    command = (tmp_path / "results" / "cmd_optimal.txt").read_text().split()
    assert command == [sys.executable, str(RUNNER), str(FAKE), "--deepspeed_config", str(optimal.resolve())]
    # a session runs the profile and the trials until one fails; each failure starts the next session: the
    # profile + z0 (fail), z1 (oom), z2 (hang), z3 + z1_offload (oom), z2_offload (hang), z3_offload
    sessions = sorted(p.name for p in (tmp_path / "exps" / "sessions").iterdir())
    assert sessions == [f"session{n}" for n in range(1, 7)]
    fourth = tmp_path / "exps" / "sessions" / "session4"
    assert sorted(p.name for p in fourth.iterdir() if p.suffix != ".txt") == ["000.json", "000.rank0.done", "001.json"]


def test_early_stopping_and_no_survivor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_TRIALS", json.dumps({"0": 9.0, "1": 1.0, "2": 1.0, "3": 1.0}))
    job = _job(tmp_path, budget=10**9, trials=50, session=False, tuner_early_stopping=2, num_tuning_micro_batch_sizes=1)
    outcome = tune(job)
    assert not (tmp_path / "exps" / "sessions").exists()  # one launch per run
    assert [t.ranked.candidate.name for t in outcome.trials] == ["z0_mbs8_gas1", "z1_mbs8_gas1", "z2_mbs8_gas1"]
    monkeypatch.setenv("FAKE_TRIALS", json.dumps({"0": "fail", "1": "fail", "2": "fail", "3": "fail"}))
    outcome = tune(_job(tmp_path, budget=10**9, trials=1))
    assert (
        outcome.best is None and write_results(outcome, results_dir=str(tmp_path / "r2"), metric="throughput") is None
    )
    assert "best: none" in (tmp_path / "r2" / "summary.txt").read_text()


def test_earlier_results_are_kept_unless_overwrite(tmp_path: Path) -> None:
    (tmp_path / "exps").mkdir()
    (tmp_path / "exps" / "old").write_text("")
    with pytest.raises(ValueError, match="autotuning.exps_dir=.*overwrite is false"):
        tune(_job(tmp_path, budget=10**9, trials=1, overwrite=False))


def test_the_profile_ranks_the_candidates_and_gives_the_flops_metric(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from slipstream.autotuning.profile import ModelProfile
    from slipstream.autotuning.throughput import CPU_LINKS, ProfiledEstimate

    profile = {
        "micro_batch": 1,
        "grad_accum": 8,
        "block_forward_s": {"layers.0": 0.002, "(rest)": 0.001},
        "step_s": 0.5,
        "flops_per_sample": 1000.0,
        "numel": 1000,
        "param_bytes": 4,
    }
    monkeypatch.setenv("FAKE_PROFILE", json.dumps(profile))
    monkeypatch.setenv("FAKE_TRIALS", json.dumps({"0": 4.0, "1": 5.0, "2": 3.0, "3": 2.0}))
    outcome = tune(_job(tmp_path, budget=10**9, trials=9, metric="flops", num_tuning_micro_batch_sizes=1))
    assert outcome.best is not None and outcome.best.ranked.candidate.stage == 1
    assert outcome.best.metrics == {"throughput": 5.0, "latency": 0.2, "flops": 5.0 * 1000.0}  # one rank
    # the estimates are the profile's samples per second (throughput.py), not the fixed model's relative figure
    profiled = json.loads((tmp_path / "exps" / "profile" / "request.json").read_text())["profiled"]
    by_name = {r.candidate.name: r.candidate for r in outcome.ranked}
    estimate = ProfiledEstimate(
        profile=ModelProfile(**profile), profiled=by_name[profiled], world=1, ranks_per_node=1, links=CPU_LINKS
    )
    assert [r.estimate for r in outcome.ranked] == [estimate(r.candidate) for r in outcome.ranked]
    monkeypatch.setenv("FAKE_PROFILE", json.dumps({**profile, "flops_per_sample": None}))
    with pytest.raises(ValueError, match="metric=flops: the profile run counted no FLOPs"):
        tune(_job(tmp_path / "again", budget=10**9, trials=9, metric="flops"))

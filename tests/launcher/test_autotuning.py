"""`slipstream run --autotuning run` end to end on one rank: the profile run, two trials (the first fails on
purpose and the tuning goes on), DeepSpeed's results layout, and the final launch with exactly the chosen config
(checked from the launched job's own view of its config)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.launcher.test_local_launch import clean_env, slipstream_run

JOB = Path(__file__).with_name("autotune_job.py")
CONFIG = {
    "train_batch_size": 8,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "autotuning": {
        "start_profile_step": 1,
        "end_profile_step": 2,
        "min_train_micro_batch_size_per_gpu": 2,
        "max_train_micro_batch_size_per_gpu": 4,
        "num_tuning_micro_batch_sizes": 1,
        "arg_mappings": {"train_micro_batch_size_per_gpu": "--batch"},
    },
}


def test_tune_then_run_the_best_config(tmp_path: Path) -> None:
    (tmp_path / "ds.json").write_text(json.dumps(CONFIG))
    view = tmp_path / "view.json"
    argv = slipstream_run(
        "--num_gpus",
        "1",
        "--autotuning",
        "run",
        "--autotuning_trials",
        "2",
        str(JOB),
        "--deepspeed_config",
        "ds.json",
        "--out",
        str(view),
        "--fail_stage",
        "0",
        "--steps",
        "3",
    )
    done = subprocess.run(argv, cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results, exps = tmp_path / "autotuning_results", tmp_path / "autotuning_exps"
    trials = sorted(p.name for p in exps.iterdir() if p.name not in ("profile", "sessions"))
    assert trials == ["z0_mbs4_gas2", "z1_mbs4_gas2"]  # the two best estimates; at most --autotuning_trials
    summary = (results / "summary.txt").read_text()
    assert "failed     exit status 1: RuntimeError: autotune_job: told to fail at ZeRO stage 0" in summary
    assert "z1_mbs4_gas2" in summary.splitlines()[2] and " best " in summary.splitlines()[2]
    assert "skipped    beyond the 1 largest micro batches that fit" in summary
    optimal = json.loads((results / "ds_config_optimal.json").read_text())
    assert optimal["zero_optimization"]["stage"] == 1 and "autotuning" not in optimal
    assert str(results.resolve() / "ds_config_optimal.json") in (results / "cmd_optimal.txt").read_text()
    seen = json.loads(view.read_text())  # written by the last launch: the run with the best config
    assert seen["config_file"] == optimal and not seen["profiled"]
    assert (seen["stage"], seen["micro_batch"], seen["grad_accum"], seen["batch_arg"]) == (1, 4, 2, 4)

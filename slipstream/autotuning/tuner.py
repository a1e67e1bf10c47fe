"""The tuner: a profile run, the planner's verdict on every candidate, then a few short trials.

Phases (`tune`):
  1. Profile: the training script runs one optimizer step under the smallest candidate, with `PROFILE_ENV`
     pointing at a request; its engine estimates every candidate on the real model (estimates.py).
  2. Prune and rank (select.py): candidates that cannot fit the memory budget are skipped with the reason, the
     rest are ordered by the throughput estimate.
  3. Trials: the best few run as launched jobs, each with its own config (`autotuning.enabled`: the engine
     times steps start_profile_step+1 .. end_profile_step, writes the metrics file and ends the run). A trial
     that fails (out of memory, an error, a timeout) is recorded with its cause and the next one runs.
     `tuner_early_stopping` trials in a row without a better metric end the phase.
Every launch is `python -m slipstream.launcher.runner` with the user's launcher flags: the tuner never imports
training code.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from slipstream.autotuning.estimates import device_is_host, read_answer
from slipstream.autotuning.files import write_json
from slipstream.autotuning.select import DEFAULT_MARGIN, Ranked, rank
from slipstream.autotuning.space import Candidate, candidate_config, grid, trial_config
from slipstream.autotuning.trial import PROFILE_ENV
from slipstream.config.plan import AutotuningPlan

__all__ = ["Job", "Outcome", "TrialResult", "launch_argv", "tune"]

OOM_MARKERS = ("out of memory", "OutOfMemoryError", "Cannot allocate memory", "MemoryError")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Job:
    """What to tune: how to launch the script, its config, the world and the budget."""

    launcher: list[str]
    """argv up to the script: the Python interpreter, `-m slipstream.launcher.runner` and the launcher flags."""
    script: list[str]
    """The script and its arguments; `script[config_at]` is the config path (replaced per trial)."""
    config_at: int
    user_config: dict[str, object]
    plan: AutotuningPlan
    world: int
    ranks_per_node: int
    budget: int
    host_budget: int | None
    max_trials: int
    timeout_s: float
    margin: float = DEFAULT_MARGIN


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TrialResult:
    ranked: Ranked
    metrics: dict[str, float] | None
    error: str
    """Why the trial gave no metrics ("" when it did)."""
    seconds: float


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Outcome:
    ranked: list[Ranked]
    trials: list[TrialResult]
    best: TrialResult | None
    best_config: dict[str, object] | None
    command: list[str] | None
    """The launch of the best config (cmd_optimal.txt)."""


def launch_argv(job: Job, config_path: Path, config: dict[str, object]) -> list[str]:
    """The launcher argv of one run: the script's config argument replaced, and each `arg_mappings` argument
    set to its config value."""
    script = list(job.script)
    script[job.config_at] = str(config_path)
    for key, flag in job.plan.arg_mappings.items():
        value = str(config.get(key, ""))
        if flag in script[1:] and script.index(flag, 1) + 1 < len(script):
            script[script.index(flag, 1) + 1] = value
        else:
            script += [flag, value]
    return [*job.launcher, *script]


def _launch(argv: list[str], *, log: Path, env: dict[str, str], timeout_s: float) -> tuple[int | None, float]:
    """Run one launch with its output in `log`; (exit status or None on timeout, seconds). A launch past its
    time is stopped with its whole process group."""
    started = time.perf_counter()
    with log.open("wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code: int | None = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            code = None
    return code, time.perf_counter() - started


def _cause(code: int | None, log: Path, timeout_s: float) -> str:
    """Why a launch gave no metrics, from its exit status and its output."""
    if code is None:
        return f"timeout after {timeout_s:.0f} s"
    text = log.read_text(errors="replace")
    if any(marker in text for marker in OOM_MARKERS):
        return "out of memory"
    errors = [line.strip() for line in text.splitlines() if "Error" in line or "error:" in line]
    detail = errors[-1][:200] if errors else f"see {log}"
    if code == 0:
        return f"ended without metrics (did the script run past end_profile_step?); {detail}"
    return f"exit status {code}: {detail}"


def _prepare_dirs(plan: AutotuningPlan) -> tuple[Path, Path]:
    exps, results = Path(plan.exps_dir), Path(plan.results_dir)
    for folder, key in ((exps, "exps_dir"), (results, "results_dir")):
        if folder.exists() and any(folder.iterdir()):
            if not plan.overwrite:
                raise ValueError(
                    f"autotuning.{key}={str(folder)!r} holds earlier results and autotuning.overwrite is false; "
                    "move them away, name another folder, or set overwrite to true"
                )
            shutil.rmtree(folder)
        folder.mkdir(parents=True, exist_ok=True)
    return exps, results


def _profile(job: Job, candidates: list[Candidate], exps: Path) -> list[Ranked]:
    """Phase 1 and 2: the profile run's estimates, then the verdicts."""
    folder = exps / "profile"
    folder.mkdir(parents=True, exist_ok=True)
    smallest = min(candidates, key=lambda c: (c.micro_batch, -c.stage, not c.offload_optimizer))
    configs = {c.name: candidate_config(job.user_config, c, world=job.world) for c in candidates}
    answer = folder / "estimates.json"
    request = {
        "candidates": configs,
        "profiled": smallest.name,
        "answer": str(answer),
        "gpus_per_node": job.ranks_per_node,
    }
    write_json(folder / "request.json", request)
    write_json(folder / "ds_config.json", configs[smallest.name])
    env = {**os.environ, PROFILE_ENV: str((folder / "request.json").resolve())}
    log = folder / "log.txt"
    argv = launch_argv(job, folder / "ds_config.json", configs[smallest.name])
    code, _ = _launch(argv, log=log, env=env, timeout_s=job.timeout_s)
    if not answer.exists():
        raise RuntimeError(
            f"autotuning: the profile run ({' '.join(argv)}) wrote no estimates: {_cause(code, log, job.timeout_s)}"
        )
    figures = read_answer(answer, {c.name: c.micro_batch for c in candidates})
    return rank(
        candidates,
        figures,
        budget=job.budget,
        host_budget=job.host_budget,
        ranks_per_node=job.ranks_per_node,
        num_micro_batches=job.plan.num_tuning_micro_batch_sizes,
        margin=job.margin,
        device_is_host=device_is_host(),
    )


def _trial(job: Job, ranked: Ranked, exps: Path) -> TrialResult:
    folder = exps / ranked.candidate.name
    folder.mkdir(parents=True, exist_ok=True)
    metrics_path = (folder / "metrics.json").resolve()
    config = trial_config(
        job.user_config, ranked.candidate, world=job.world, plan=job.plan, metric_path=str(metrics_path)
    )
    write_json(folder / "ds_config.json", config)
    log = folder / "log.txt"
    env = {k: v for k, v in os.environ.items() if k != PROFILE_ENV}
    code, seconds = _launch(
        launch_argv(job, folder / "ds_config.json", config), log=log, env=env, timeout_s=job.timeout_s
    )
    if code == 0 and metrics_path.exists():
        return TrialResult(ranked=ranked, metrics=json.loads(metrics_path.read_text()), error="", seconds=seconds)
    return TrialResult(ranked=ranked, metrics=None, error=_cause(code, log, job.timeout_s), seconds=seconds)


def better(metric: str, new: dict[str, float], old: dict[str, float] | None) -> bool:
    """Whether `new` beats `old` on the metric (throughput: higher; latency: lower)."""
    if old is None:
        return True
    return new[metric] < old[metric] if metric == "latency" else new[metric] > old[metric]


def tune(job: Job) -> Outcome:
    """Run the three phases (see the module's docstring) and return what they found."""
    if job.plan.metric not in ("throughput", "latency"):
        raise ValueError(f"autotuning.metric={job.plan.metric!r} is not implemented; use throughput or latency")
    exps, _results = _prepare_dirs(job.plan)
    candidates = grid(job.plan, job.user_config, world=job.world)
    if not candidates:
        raise ValueError(
            "autotuning: no micro batch size between min_train_micro_batch_size_per_gpu and "
            "max_train_micro_batch_size_per_gpu divides train_batch_size over the ranks; widen the range"
        )
    ranked = _profile(job, candidates, exps)
    kept = [r for r in ranked if not r.skipped]
    trials: list[TrialResult] = []
    best: TrialResult | None = None
    since_better = 0
    for item in kept[: min(job.max_trials, job.plan.tuner_num_trials)]:
        result = _trial(job, item, exps)
        trials.append(result)
        if result.metrics is not None and better(job.plan.metric, result.metrics, best.metrics if best else None):
            best, since_better = result, 0
        else:
            since_better += 1
            if since_better >= job.plan.tuner_early_stopping:
                break
    if best is None:
        return Outcome(ranked=ranked, trials=trials, best=None, best_config=None, command=None)
    config = candidate_config(job.user_config, best.ranked.candidate, world=job.world)
    command = launch_argv(job, Path(job.plan.results_dir).resolve() / "ds_config_optimal.json", config)
    return Outcome(ranked=ranked, trials=trials, best=best, best_config=config, command=command)

"""The tuner: a profile run, the planner's verdict on every candidate, then a few short trials.

Phases (`tune`):
  1. Profile: the training script runs two optimizer steps under the smallest candidate, with `PROFILE_ENV`
     pointing at a request; its engine counts and times the model (profile.py) and estimates every candidate on
     the real model (estimates.py).
  2. Prune and rank (select.py): candidates that cannot fit the memory budget are skipped with the reason, the
     rest are ordered by the throughput estimate from the profile (throughput.py).
  3. Trials: the kept candidates run in the order of `tuner_type` (order.py), each with its own config
     (`autotuning.enabled`: the engine times steps start_profile_step+1 .. end_profile_step, writes the metrics
     file and ends the run). A trial that fails (out of memory, an error, a timeout) is recorded with its cause
     and the next one runs. `tuner_early_stopping` trials in a row without a better metric end the phase.
On one node the profile run and the trials run in one session (launches.py: the same ranks and process group,
the script run again per trial); a failed run ends its session and the next run starts another. Every launch is
`python -m slipstream.launcher.runner` with the user's launcher flags: the tuner never imports training code.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from slipstream.autotuning.estimates import device_is_host, read_answer, read_profile
from slipstream.autotuning.files import write_json
from slipstream.autotuning.launches import Launches, Relaunch, Session, cause
from slipstream.autotuning.order import make_order
from slipstream.autotuning.profile import ModelProfile
from slipstream.autotuning.select import DEFAULT_MARGIN, Ranked, estimated_throughput, rank
from slipstream.autotuning.space import Candidate, candidate_config, data_parallel, grid, trial_config
from slipstream.autotuning.throughput import ProfiledEstimate, default_links
from slipstream.config.plan import AutotuningPlan

__all__ = ["Job", "Outcome", "TrialResult", "better", "launch_argv", "launches_for", "run_trial", "script_argv", "tune"]


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
    seed: int = 0
    """The seed of `tuner_type: random`."""
    session: bool = True
    """Run the trials in one session where the world allows it (launches.py); False: one launch per run."""

    @property
    def data_parallel(self) -> int:
        """The data-parallel ranks: the world over `autotuning.mp_size`."""
        return data_parallel(self.world, self.plan)


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


def script_argv(job: Job, config_path: Path, config: dict[str, object]) -> list[str]:
    """The script's argv of one run: the config argument replaced, and each `arg_mappings` argument set to its
    config value."""
    script = list(job.script)
    script[job.config_at] = str(config_path)
    for key, flag in job.plan.arg_mappings.items():
        value = str(config.get(key, ""))
        if flag in script[1:] and script.index(flag, 1) + 1 < len(script):
            script[script.index(flag, 1) + 1] = value
        else:
            script += [flag, value]
    return script


def launch_argv(job: Job, config_path: Path, config: dict[str, object]) -> list[str]:
    """The launcher argv of one run on its own (cmd_optimal.txt)."""
    return [*job.launcher, *script_argv(job, config_path, config)]


def launches_for(job: Job, exps: Path) -> Launches:
    """A session on one node unless the launcher flags run a module or a program; else one launch per run."""
    wraps = not {"--module", "--no_python"} & set(job.launcher)
    if job.session and wraps and job.world == job.ranks_per_node:
        return Session(job.launcher, root=exps / "sessions", world=job.world, timeout_s=job.timeout_s)
    return Relaunch(job.launcher, timeout_s=job.timeout_s)


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


def _profile(
    job: Job, candidates: list[Candidate], exps: Path, launches: Launches
) -> tuple[list[Ranked], ModelProfile | None]:
    """Phase 1 and 2: the profile run's estimates and profile, then the verdicts. The profiled candidate is the
    one likely to need least (smallest micro batch, highest stage, offload) with activation checkpointing off, so
    the activations it measures are the full ones (estimates.py)."""
    folder = exps / "profile"
    folder.mkdir(parents=True, exist_ok=True)
    smallest = min(
        candidates,
        key=lambda c: (
            c.micro_batch,
            -c.stage,
            not c.offload_optimizer,
            not c.offload_param,
            c.activation_checkpointing is True,
        ),
    )
    configs = {c.name: candidate_config(job.user_config, c, world=job.data_parallel) for c in candidates}
    answer = folder / "estimates.json"
    request = {
        "candidates": configs,
        "profiled": smallest.name,
        "answer": str(answer.resolve()),
        "gpus_per_node": job.ranks_per_node,
    }
    write_json(folder / "request.json", request)
    write_json(folder / "ds_config.json", configs[smallest.name])
    script = script_argv(job, (folder / "ds_config.json").resolve(), configs[smallest.name])
    ran = launches.run(script, profile=str((folder / "request.json").resolve()), folder=folder)
    if not answer.exists():
        why = cause(ran, timeout_s=job.timeout_s, where=folder / "log.txt")
        raise RuntimeError(f"autotuning: the profile run ({' '.join(script)}) wrote no estimates: {why}")
    profile = read_profile(answer)
    ranked = rank(
        candidates,
        read_answer(answer, candidates),
        budget=job.budget,
        host_budget=job.host_budget,
        ranks_per_node=job.ranks_per_node,
        num_micro_batches=job.plan.num_tuning_micro_batch_sizes,
        margin=job.margin,
        device_is_host=device_is_host(),
        estimate=estimated_throughput if profile is None else _estimator(job, profile, smallest),
    )
    return ranked, profile


def _estimator(job: Job, profile: ModelProfile, profiled: Candidate) -> ProfiledEstimate:
    return ProfiledEstimate(
        profile=profile,
        profiled=profiled,
        world=job.data_parallel,
        ranks_per_node=job.ranks_per_node,
        links=default_links(device_is_host()),
    )


def with_flops(job: Job, metrics: dict[str, float], profile: ModelProfile | None) -> dict[str, float]:
    """`metrics` with `flops`: the model's FLOPs per second per rank (the profile's FLOPs per sample of one
    rank's model times the samples per second of one data-parallel replica); unchanged without a count."""
    if profile is None or profile.flops_per_sample is None:
        return metrics
    return {**metrics, "flops": float(metrics["throughput"]) * profile.flops_per_sample / job.data_parallel}


def run_trial(
    job: Job, ranked: Ranked, folder: Path, launches: Launches, profile: ModelProfile | None = None
) -> TrialResult:
    """One trial of `ranked` with its files in `folder`: its metrics, or why it gave none."""
    folder.mkdir(parents=True, exist_ok=True)
    metrics_path = (folder / "metrics.json").resolve()
    metrics_path.unlink(missing_ok=True)
    config = trial_config(
        job.user_config, ranked.candidate, world=job.data_parallel, plan=job.plan, metric_path=str(metrics_path)
    )
    write_json(folder / "ds_config.json", config)
    ran = launches.run(script_argv(job, (folder / "ds_config.json").resolve(), config), profile="", folder=folder)
    if ran.code == 0 and metrics_path.exists():
        metrics = with_flops(job, json.loads(metrics_path.read_text()), profile)
        return TrialResult(ranked=ranked, metrics=metrics, error="", seconds=ran.seconds)
    error = cause(ran, timeout_s=job.timeout_s, where=folder / "log.txt")
    return TrialResult(ranked=ranked, metrics=None, error=error, seconds=ran.seconds)


def better(metric: str, new: dict[str, float], old: dict[str, float] | None) -> bool:
    """Whether `new` beats `old` on the metric (throughput: higher; latency: lower)."""
    if old is None:
        return True
    return new[metric] < old[metric] if metric == "latency" else new[metric] > old[metric]


def _trials(
    job: Job, kept: list[Ranked], exps: Path, launches: Launches, profile: ModelProfile | None
) -> tuple[list[TrialResult], TrialResult | None]:
    """Phase 3: the trials in the order of `tuner_type`, up to the trial limit and early stopping."""
    order = make_order(job.plan.tuner_type, kept, seed=job.seed)
    trials: list[TrialResult] = []
    best: TrialResult | None = None
    since_better = 0
    while len(trials) < min(job.max_trials, job.plan.tuner_num_trials):
        item = order.next()
        if item is None:
            break
        result = run_trial(job, item, exps / item.candidate.name, launches, profile)
        trials.append(result)
        order.observe(item, None if result.metrics is None else float(result.metrics["throughput"]))
        if result.metrics is not None and better(job.plan.metric, result.metrics, best.metrics if best else None):
            best, since_better = result, 0
        else:
            since_better += 1
            if since_better >= job.plan.tuner_early_stopping:
                break
    return trials, best


def tune(job: Job) -> Outcome:
    """Run the three phases (see the module's docstring) and return what they found."""
    if job.plan.metric not in ("throughput", "latency", "flops"):
        raise ValueError(f"autotuning.metric={job.plan.metric!r} is not one of throughput, latency, flops")
    make_order(job.plan.tuner_type, [], seed=job.seed)  # an unknown tuner_type fails before any launch
    exps, _results = _prepare_dirs(job.plan)
    candidates = grid(job.plan, job.user_config, world=job.data_parallel)
    if not candidates:
        raise ValueError(
            "autotuning: no micro batch size between min_train_micro_batch_size_per_gpu and "
            "max_train_micro_batch_size_per_gpu divides train_batch_size over the ranks; widen the range"
        )
    launches = launches_for(job, exps)
    try:
        ranked, profile = _profile(job, candidates, exps, launches)
        if job.plan.metric == "flops" and (profile is None or profile.flops_per_sample is None):
            raise ValueError(
                "autotuning.metric=flops: the profile run counted no FLOPs (no matmul-class op in the model's "
                "step); use metric throughput"
            )
        trials, best = _trials(job, [r for r in ranked if not r.skipped], exps, launches, profile)
    finally:
        launches.close()
    if best is None:
        return Outcome(ranked=ranked, trials=trials, best=None, best_config=None, command=None)
    config = candidate_config(job.user_config, best.ranked.candidate, world=job.data_parallel)
    command = launch_argv(job, Path(job.plan.results_dir).resolve() / "ds_config_optimal.json", config)
    return Outcome(ranked=ranked, trials=trials, best=best, best_config=config, command=command)

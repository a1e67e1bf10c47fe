"""What `tune` leaves in `autotuning.results_dir`, in DeepSpeed's layout: `ds_config_optimal.json`,
`cmd_optimal.txt`, `summary.txt` (every candidate: its planner figure, the verdict, the trial's metric or its
failure), and `trials.png` when matplotlib is installed (it is not a dependency: without it no plot)."""

from __future__ import annotations

import importlib.util
import shlex
from pathlib import Path

from slipstream.autotuning.space import optimal_config
from slipstream.autotuning.tuner import Outcome, TrialResult

__all__ = ["summary", "write_results"]

MIB = 2**20


def _row(name: str, needed: int, estimate: float, status: str, value: str) -> str:
    return f"{name:<36} {needed / MIB:>12.1f} {estimate:>9.3f}  {status:<10} {value}"


def summary(outcome: Outcome, *, metric: str) -> str:
    """The table of summary.txt: trials first (in the order they ran), then the candidates not run."""
    trials = {t.ranked.candidate.name: t for t in outcome.trials}
    lines = [f"{'candidate':<36} {'planned MiB':>12} {'estimate':>9}  {'status':<10} {metric}"]
    for trial in outcome.trials:
        r = trial.ranked
        value = f"{trial.metrics[metric]:.4g}" if trial.metrics else trial.error
        status = "best" if outcome.best is trial else ("ran" if trial.metrics else "failed")
        lines.append(_row(r.candidate.name, r.needed, r.estimate, status, value))
    for r in outcome.ranked:
        if r.candidate.name not in trials:
            lines.append(
                _row(
                    r.candidate.name,
                    r.needed,
                    r.estimate,
                    "skipped" if r.skipped else "not run",
                    r.skipped or "ranked below the trials that ran",
                )
            )
    best = outcome.best
    lines.append("")
    lines.append(
        f"best: {best.ranked.candidate.name} ({metric} {best.metrics[metric]:.4g})"
        if best is not None and best.metrics
        else "best: none (no trial wrote metrics; see the failures above)"
    )
    return "\n".join(lines) + "\n"


def _plot(trials: list[TrialResult], *, metric: str, path: Path) -> None:
    if importlib.util.find_spec("matplotlib") is None:
        return
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    ran = [t for t in trials if t.metrics]
    figure, axes = pyplot.subplots(figsize=(max(4.0, 1.2 * len(ran)), 3.5))
    axes.bar([t.ranked.candidate.name for t in ran], [t.metrics[metric] for t in ran if t.metrics])
    axes.set_ylabel(metric)
    axes.tick_params(axis="x", labelrotation=30)
    figure.tight_layout()
    figure.savefig(path)
    pyplot.close(figure)


def write_results(outcome: Outcome, *, results_dir: str, metric: str) -> Path | None:
    """Write the results files; returns the optimal config's path (None when no trial succeeded)."""
    folder = Path(results_dir)
    folder.mkdir(parents=True, exist_ok=True)
    text = summary(outcome, metric=metric)
    (folder / "summary.txt").write_text(text)
    print(text, flush=True)
    _plot(outcome.trials, metric=metric, path=folder / "trials.png")
    if outcome.best_config is None or outcome.command is None:
        return None
    path = folder / "ds_config_optimal.json"
    path.write_text(optimal_config(outcome.best_config))
    (folder / "cmd_optimal.txt").write_text(shlex.join(outcome.command) + "\n")
    return path

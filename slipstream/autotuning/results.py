"""What `tune` leaves in `autotuning.results_dir`, in DeepSpeed's layout: `ds_config_optimal.json`,
`cmd_optimal.txt`, `summary.txt` (every candidate: its planner figure, the verdict, the trial's metric or its
failure), and `trials.png` when matplotlib is installed (it is not a dependency: without it no plot): each trial's
metric against the planner's memory per rank, the chosen config marked."""

from __future__ import annotations

import importlib.util
import shlex
from pathlib import Path

from slipstream.autotuning.space import optimal_config
from slipstream.autotuning.tuner import Outcome

__all__ = ["summary", "write_results"]

MIB = 2**20


def _row(name: str, needed: int, estimate: float, status: str, value: str) -> str:
    return f"{name:<48} {needed / MIB:>12.1f} {estimate:>9.4g}  {status:<10} {value}"


def summary(outcome: Outcome, *, metric: str) -> str:
    """The table of summary.txt: trials first (in the order they ran), then the candidates not run."""
    trials = {t.ranked.candidate.name: t for t in outcome.trials}
    lines = [f"{'candidate':<48} {'planned MiB':>12} {'estimate':>9}  {'status':<10} {metric}"]
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


def _plot(outcome: Outcome, *, metric: str, path: Path) -> None:
    """The trials' metric against the planner's memory per rank, each point named, the chosen one marked."""
    if importlib.util.find_spec("matplotlib") is None:
        return
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    ran = [t for t in outcome.trials if t.metrics]
    figure, axes = pyplot.subplots(figsize=(6.0, 4.0))
    for trial in ran:
        x, y = trial.ranked.needed / MIB, trial.metrics[metric] if trial.metrics else 0.0
        chosen = trial is outcome.best
        axes.scatter([x], [y], marker="*" if chosen else "o", s=160 if chosen else 30, color="C3" if chosen else "C0")
        axes.annotate(trial.ranked.candidate.name + (" (chosen)" if chosen else ""), (x, y), fontsize=7)
    axes.set_xlabel("planned memory per rank (MiB)")
    axes.set_ylabel(metric)
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
    _plot(outcome, metric=metric, path=folder / "trials.png")
    if outcome.best_config is None or outcome.command is None:
        return None
    path = folder / "ds_config_optimal.json"
    path.write_text(optimal_config(outcome.best_config))
    (folder / "cmd_optimal.txt").write_text(shlex.join(outcome.command) + "\n")
    return path

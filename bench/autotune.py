"""Benchmark of the autotuner: the planner-guided tuner against an exhaustive sweep of the same space, and
DeepSpeed's autotuner on the same script and config.

    python bench/autotune.py [--quick] [--num-gpus 2] [--peer-python .bench-venv/bin/python] [--no-deepspeed]

The script is bench/_autotune_job.py (the example GPT, 4 layers x 256, seq 64, fp32 AdamW), at 2 ranks. The
space: ZeRO 0-3, optimizer offload (none/CPU), at stage 3 also the parameters offloaded (alone and with the
optimizer), micro batch 4, 8 and 16 (--quick: 8 and 16); trials time steps
4..8. The memory cap (`--autotuning_memory`) is set from the planner's figures of every candidate so that about
half of the space cannot fit; both runs get it.
    tuner        `slipstream run --autotuning tune` as shipped (profile run, pruning, at most 3 trials)
    exhaustive   the same command with every candidate under the cap run (num_tuning_micro_batch_sizes,
                 tuner_early_stopping and --autotuning_trials raised past the space's size)
Printed: trials, wall time, and the chosen-throughput ratio: the exhaustive sweep's measured throughput of the
candidate the tuner chose over the best throughput the sweep measured (both from the sweep's own trials, so the
ratio is not two runs' noise). DeepSpeed's row runs `deepspeed --autotuning tune` in the peer environment and
prints its wall time and how it ended (the last error line when it fails; stopped after --deepspeed-timeout).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "bench" / "_autotune_job.py"
MARGIN = 0.10  # the tuner's default (autotuning/select.py)


def _config(quick: bool, exhaustive: bool) -> dict[str, object]:
    tuning: dict[str, object] = {
        "start_profile_step": 3,
        "end_profile_step": 8,
        "min_train_micro_batch_size_per_gpu": 8 if quick else 4,
        "max_train_micro_batch_size_per_gpu": 16,
    }
    if exhaustive:
        tuning.update(num_tuning_micro_batch_sizes=100, tuner_early_stopping=100, tuner_num_trials=100)
    return {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "autotuning": tuning,
    }


def _run(argv: list[str], folder: Path, timeout_s: float) -> tuple[int | None, float, str]:
    """Run `argv` in `folder`; past `timeout_s` its whole process group is killed (exit status None)."""
    # DeepSpeed's autotuner launches its experiments with `deepspeed` from PATH: the launcher's folder first
    path = f"{Path(argv[0]).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PATH": path}
    started = time.perf_counter()
    process = subprocess.Popen(
        argv, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        return None, time.perf_counter() - started, output
    return process.returncode, time.perf_counter() - started, output


def _trials(folder: Path) -> dict[str, float | None]:
    """Each trial's throughput (None: it failed) from the experiment folders."""
    found: dict[str, float | None] = {}
    for trial in sorted((folder / "autotuning_exps").iterdir()):
        if trial.name not in ("profile", "sessions"):
            metrics = trial / "metrics.json"
            found[trial.name] = json.loads(metrics.read_text())["throughput"] if metrics.exists() else None
    return found


def _tune(
    folder: Path,
    launcher: list[str],
    *,
    config: dict[str, object],
    num_gpus: int,
    launcher_extra: tuple[str, ...] = (),
    script_extra: tuple[str, ...] = (),
    timeout_s: float = 3600,
) -> tuple[int | None, float, str]:
    """`<launcher> --num_gpus N --autotuning tune JOB --deepspeed_config ds.json` in `folder`."""
    folder.mkdir(parents=True)
    (folder / "ds.json").write_text(json.dumps(config))
    argv = [
        *launcher,
        "--num_gpus",
        str(num_gpus),
        "--autotuning",
        "tune",
        *launcher_extra,
        str(JOB),
        "--deepspeed_config",
        "ds.json",
        *script_extra,
    ]
    return _run(argv, folder, timeout_s)


def memory_cap(*, quick: bool, num_gpus: int) -> tuple[int, int, int]:
    """(a budget per rank under which about half of the space cannot fit, candidates excluded, candidates): the
    planner's figures of every candidate on the bench model (model states; on the CPU activations are not
    counted), the budget just under one of them (less the tuner's margin) that excludes the nearest to half."""
    sys.path.insert(0, str(ROOT / "bench"))
    from _autotune_job import bench_model

    from slipstream.autotuning.estimates import estimate_config
    from slipstream.autotuning.space import candidate_config, grid
    from slipstream.config import resolve

    config = _config(quick, exhaustive=False)
    plan = resolve(config, world_size=num_gpus).autotuning
    model = bench_model()
    needed = sorted(
        sum(
            estimate_config(
                candidate_config(config, c, world=num_gpus), module=model, world_size=num_gpus, gpus_per_node=num_gpus
            )
        )
        for c in grid(plan, config, world=num_gpus)
    )
    caps = [int(value * (1 - MARGIN)) - 1 for value in set(needed)]  # each excludes that figure and above
    excluded = {cap: sum(n * (1 - MARGIN) > cap for n in needed) for cap in caps}
    cap = min(caps, key=lambda c: abs(excluded[c] - len(needed) / 2))
    return cap, excluded[cap], len(needed)


def _slipstream(folder: Path, *, quick: bool, exhaustive: bool, num_gpus: int, cap: int) -> tuple[float, dict, str]:
    launcher = [sys.executable, "-m", "slipstream.cli.main", "run"]
    extra = ("--autotuning_memory", str(cap)) + (("--autotuning_trials", "100") if exhaustive else ())
    code, wall, output = _tune(
        folder, launcher, config=_config(quick, exhaustive), num_gpus=num_gpus, launcher_extra=extra
    )
    if code != 0:
        raise SystemExit(f"slipstream run --autotuning failed ({code}):\n{output[-3000:]}")
    best = json.loads((folder / "autotuning_results" / "ds_config_optimal.json").read_text())
    zero = best["zero_optimization"]
    chosen = (
        f"z{zero['stage']}{'_offload' if 'offload_optimizer' in zero else ''}"
        f"{'_params' if 'offload_param' in zero else ''}"
        f"_mbs{best['train_micro_batch_size_per_gpu']}_gas{best['gradient_accumulation_steps']}"
    )
    return wall, _trials(folder), chosen


def _deepspeed(folder: Path, *, peer: Path, quick: bool, num_gpus: int, timeout_s: float) -> str:
    code, wall, output = _tune(
        folder,
        [str(peer.parent / "deepspeed")],
        config=_config(quick, exhaustive=False),
        num_gpus=num_gpus,
        script_extra=("--peer",),
        timeout_s=timeout_s,
    )
    errors = [line.strip() for line in output.splitlines() if "Error" in line or "error" in line]
    experiments = sorted(p.parent.name for p in (folder / "autotuning_results").glob("*/exp.json"))
    if code is None:
        ended = (
            f"stopped after {timeout_s:.0f} s with experiment {experiments[-1] if experiments else 'none'} unfinished"
        )
    else:
        ended = "exited 0" if code == 0 else f"exit {code}"
        ended += f" ({errors[-1][:160]})" if errors else ""
    results = folder / "autotuning_results" / "ds_config_optimal.json"
    return (
        f"deepspeed --autotuning tune: {wall:.1f} s, {ended}; experiments launched: {len(experiments)}; "
        f"ds_config_optimal.json written: {results.exists()}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--num-gpus", type=int, default=2)
    parser.add_argument("--peer-python", type=Path, default=ROOT / ".bench-venv" / "bin" / "python")
    parser.add_argument("--no-deepspeed", action="store_true")
    parser.add_argument(
        "--deepspeed-timeout", type=float, default=300.0, help="seconds before DeepSpeed's tuner is stopped"
    )
    args = parser.parse_args()
    cap, excluded, total = memory_cap(quick=args.quick, num_gpus=args.num_gpus)
    print(f"memory cap per rank: {cap / 2**20:.1f} MiB; {excluded} of the {total} candidates cannot fit under it")
    with tempfile.TemporaryDirectory(prefix="bench-autotune-") as tmp:
        tuner_wall, tuner_trials, chosen = _slipstream(
            Path(tmp) / "tuner", quick=args.quick, exhaustive=False, num_gpus=args.num_gpus, cap=cap
        )
        sweep_wall, sweep_trials, best = _slipstream(
            Path(tmp) / "sweep", quick=args.quick, exhaustive=True, num_gpus=args.num_gpus, cap=cap
        )
        measured = {k: v for k, v in sweep_trials.items() if v is not None}
        print(f"{'':<12} {'trials':>6} {'wall s':>8}  chosen")
        print(f"{'tuner':<12} {len(tuner_trials):>6} {tuner_wall:>8.1f}  {chosen}")
        print(f"{'exhaustive':<12} {len(sweep_trials):>6} {sweep_wall:>8.1f}  {best}")
        ratio = measured.get(chosen, 0.0) / max(measured.values())
        print(f"chosen throughput ratio (sweep's figure for the tuner's choice / sweep's best): {ratio:.2f}")
        print(f"wall time ratio tuner / exhaustive: {tuner_wall / sweep_wall:.2f}")
        print("sweep trials (samples/s): " + ", ".join(f"{k} {v:.0f}" for k, v in measured.items()))
        print("tuner trials (samples/s): " + ", ".join(f"{k} {v or 0:.0f}" for k, v in tuner_trials.items()))
        if not args.no_deepspeed and args.peer_python.exists():
            print(
                _deepspeed(
                    Path(tmp) / "deepspeed",
                    peer=args.peer_python,
                    quick=args.quick,
                    num_gpus=args.num_gpus,
                    timeout_s=args.deepspeed_timeout,
                )
            )
        elif not args.no_deepspeed:
            print(f"deepspeed: no peer environment at {args.peer_python} (bench/make_peer_venv.sh)")


if __name__ == "__main__":
    main()

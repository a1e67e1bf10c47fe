"""`slipstream run --autotuning tune|run script.py --deepspeed_config ds.json` (DeepSpeed's `deepspeed
--autotuning ...`): the job to tune from the launcher's flags and the script's config, the tuner, its results,
and for `run` the launch of the best config.

Our own flags (cli/run.py): `--autotuning_memory SIZE` (the memory budget per rank; default the accelerator's
memory, shared by the local ranks when the accelerator is the CPU), `--autotuning_trials N` (most full trials,
default 3), `--autotuning_timeout S` (seconds per launch, default 600) and `--autotuning_nvme_path DIR` (search the
NVMe offloads there, as when the config names an `nvme_path`).
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from slipstream.accelerator import get_accelerator
from slipstream.accelerator.cpu import host_total_memory
from slipstream.autotuning.estimates import device_is_host
from slipstream.autotuning.results import write_results
from slipstream.autotuning.space import tunable_config, with_nvme_path
from slipstream.autotuning.tuner import Job, tune
from slipstream.config import load_config, resolve
from slipstream.launcher import runner

__all__ = ["CONFIG_FLAGS", "DEFAULT_TRIALS", "config_position", "job_from_args", "launcher_flags", "run_autotuning"]

CONFIG_FLAGS = ("--deepspeed_config", "--deepspeed")
"""The script arguments that carry the config path (DeepSpeed's, and the Hugging Face Trainer's)."""
DEFAULT_TRIALS = 3
DEFAULT_TIMEOUT_S = 600.0


def config_position(script: list[str]) -> tuple[list[str], int]:
    """(the script's argv with `--flag=value` split, the index of the config path in it)."""
    split: list[str] = []
    for item in script:
        flag, eq, value = item.partition("=")
        split += [flag, value] if eq and flag in CONFIG_FLAGS else [item]
    for index, item in enumerate(split[:-1]):
        if item in CONFIG_FLAGS:
            return split, index + 1
    raise ValueError(
        "--autotuning: the training script's arguments name no config; pass it as --deepspeed_config PATH "
        "(the tuner gives each trial its own config through that argument)"
    )


def launcher_flags(args: argparse.Namespace) -> list[str]:
    """The launcher flags of `args` that differ from their defaults, as argv (without --autotuning)."""
    parser = argparse.ArgumentParser(add_help=False)
    runner.add_arguments(parser)
    flags: list[str] = []
    for action in parser._actions:  # argparse keeps its actions here; there is no public accessor
        if not action.option_strings or action.dest == "autotuning":
            continue
        value = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = next(o for o in action.option_strings if o.startswith("--"))
        flags += [flag] if action.nargs == 0 else [flag, str(value)]  # nargs 0: a store_true switch
    return flags


def job_from_args(args: argparse.Namespace) -> Job:
    """The job of a `slipstream run --autotuning ...` command line (ValueError names a wrong flag)."""
    launch, _multi = runner.prepare(args)
    script, config_at = config_position([args.user_script, *args.user_args])
    user_config = with_nvme_path(dict(load_config(script[config_at])), getattr(args, "autotuning_nvme_path", None))
    world, per_node = launch.world_size, max(len(slots) for slots in launch.world.values())
    plan = resolve(tunable_config(dict(user_config)), world_size=world).autotuning
    on_host = device_is_host()
    total = args.autotuning_memory or int(get_accelerator().total_memory())
    return Job(
        launcher=[sys.executable, "-m", "slipstream.launcher.runner", *launcher_flags(args)],
        script=script,
        config_at=config_at,
        user_config=dict(user_config),
        plan=plan,
        budget=total if args.autotuning_memory or not on_host else total // per_node,
        host_budget=None if on_host else host_total_memory(),
        world=world,
        ranks_per_node=per_node,
        max_trials=args.autotuning_trials,
        timeout_s=args.autotuning_timeout,
    )


def run_autotuning(args: argparse.Namespace) -> int:
    """Tune (and for `run`, launch the best config); returns the exit status."""
    try:
        job = job_from_args(args)
        outcome = tune(job)
    except ValueError as error:
        print(f"slipstream run: error: {error}", file=sys.stderr)
        return 2
    optimal = write_results(outcome, results_dir=job.plan.results_dir, metric=job.plan.metric)
    if optimal is None or outcome.command is None:
        print("slipstream run: autotuning found no configuration that ran; see summary.txt", file=sys.stderr)
        return 1
    print(f"slipstream: the best config is in {optimal}; its command in cmd_optimal.txt", flush=True)
    if args.autotuning != "run":
        return 0
    return subprocess.call(outcome.command)

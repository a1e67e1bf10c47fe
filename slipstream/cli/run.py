"""`slipstream run`: the launcher subcommand (DeepSpeed's `deepspeed` command); the logic is launcher/runner.py.

Owns the hook into the `slipstream` command and the DeepSpeed-style short form: `slipstream script.py
args` or `slipstream --num_gpus 2 script.py args` (no subcommand) means `slipstream run ...`.
"""

from __future__ import annotations

import argparse
import os

from slipstream.cli.sizes import parse_bytes, positive_int
from slipstream.launcher import runner

HELP = "launch a training script on this machine or many (DeepSpeed's `deepspeed` command)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    runner.add_arguments(parser)
    add = parser.add_argument
    add(
        "--autotuning_memory",
        type=parse_bytes,
        default=None,
        help="autotuning: memory budget per rank "
        "(Slipstream's; default the accelerator's memory, shared by the local ranks on the CPU), e.g. 16G",
    )
    add("--autotuning_trials", type=positive_int, default=3, help="autotuning: most full trials (Slipstream's)")
    add("--autotuning_timeout", type=float, default=600.0, help="autotuning: seconds per launch (Slipstream's)")
    add("--autotuning_nvme_path", default=None, help="autotuning: search NVMe offload in this folder (Slipstream's)")


def run(args: argparse.Namespace) -> int:
    if getattr(args, "autotuning", ""):  # the tuner launches the script itself (slipstream/autotuning/)
        from slipstream.autotuning.command import run_autotuning

        return run_autotuning(args)
    return runner.run(args)


def is_short_form(argv: list[str], *, subcommands: set[str]) -> bool:
    """True when `argv` starts like a `run` command line without the word `run`.

    That is: the first item is not a subcommand nor -h/--help/--version, and it is a launcher flag
    (starts with '-'), an existing file, or ends with `.py`.
    """
    if not argv or argv[0] in subcommands or argv[0] in ("-h", "--help", "--version"):
        return False
    first = argv[0]
    return first.startswith("-") or first.endswith(".py") or os.path.isfile(first)

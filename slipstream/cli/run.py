"""`slipstream run`: the launcher subcommand (DeepSpeed's `deepspeed` command); the logic is launcher/runner.py.

Owns the hook into the `slipstream` command and the DeepSpeed-style short form: `slipstream script.py
args` or `slipstream --num_gpus 2 script.py args` (no subcommand) means `slipstream run ...`.
"""

from __future__ import annotations

import argparse
import os

from slipstream.launcher import runner

HELP = "launch a training script on this machine or many (DeepSpeed's `deepspeed` command)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    runner.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
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

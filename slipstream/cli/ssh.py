"""`slipstream ssh [-H HOSTFILE] [-i/-e FILTER] [--launcher_args ARGS] -- CMD...` (DeepSpeed's `ds_ssh`): run
one command on every host of the hostfile in parallel, output prefixed by host, and say how each host ended."""

from __future__ import annotations

import argparse
import sys

HELP = "run one command on every host of the hostfile in parallel (DeepSpeed's ds_ssh)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from slipstream.launcher.runner import DEFAULT_HOSTFILE

    parser.add_argument("-H", "--hostfile", default=DEFAULT_HOSTFILE, help="hostfile (`host slots=N` lines)")
    parser.add_argument("-i", "--include", default="", help="only these hosts (DeepSpeed's -i syntax)")
    parser.add_argument("-e", "--exclude", default="", help="not these hosts (DeepSpeed's -e syntax)")
    parser.add_argument(
        "--launcher_args",
        "--ssh_args",
        dest="launcher_args",
        default="",
        help='ssh client options, e.g. "-p 2222 -i ~/.ssh/key"',
    )
    parser.add_argument("--timeout", type=float, default=None, help="seconds before a host's command is killed")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")


def run(args: argparse.Namespace) -> int:
    from slipstream.launcher.hostfile import filter_world, read_hostfile, world_of
    from slipstream.launcher.parallel_ssh import overall_status, run_on_hosts

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        resources = read_hostfile(args.hostfile)
        if resources is None:
            raise ValueError(
                f"hostfile {args.hostfile} does not exist; pass -H with a hostfile of `host slots=N` lines"
            )
        world = filter_world(
            world_of(resources), include=args.include, exclude=args.exclude, source=f"hostfile {args.hostfile}"
        )
        results = run_on_hosts(list(world), command, launcher_args=args.launcher_args, timeout_s=args.timeout)
    except ValueError as error:
        print(f"slipstream ssh: error: {error}", file=sys.stderr)
        return 2
    for result in results:
        print(f"slipstream ssh: {result.host} exited {result.returncode}", file=sys.stderr)
    return overall_status(results)

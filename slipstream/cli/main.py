"""Entry point of the `slipstream` command: parses the subcommand and hands over to its module."""

from __future__ import annotations

import argparse
import sys

from slipstream import __version__

SUBCOMMANDS = ("report", "run", "export", "plan", "elastic", "bench", "io", "nvme")
"""Every subcommand name: a first argument outside this list may be DeepSpeed's short form of `run`."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slipstream", description="Slipstream: ZeRO training with DeepSpeed's API.")
    parser.add_argument("--version", action="version", version=f"slipstream {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    from slipstream import report

    report_parser = commands.add_parser("report", help="environment and native-op report (DeepSpeed's ds_report)")
    report.add_arguments(report_parser)
    report_parser.set_defaults(handler=report.run)
    from slipstream.cli import run as run_command

    run_parser = commands.add_parser("run", help=run_command.HELP, description=run_command.HELP)
    run_command.add_arguments(run_parser)
    run_parser.set_defaults(handler=run_command.run)
    from slipstream.cli import export as export_command

    export_parser = commands.add_parser("export", help=export_command.HELP, description=export_command.HELP)
    export_command.add_arguments(export_parser)
    export_parser.set_defaults(handler=export_command.run)
    from slipstream.cli import plan as plan_command

    plan_parser = commands.add_parser("plan", help=plan_command.HELP, description=plan_command.HELP)
    plan_command.add_arguments(plan_parser)
    plan_parser.set_defaults(handler=plan_command.run)
    from slipstream.cli import elastic as elastic_command

    elastic_parser = commands.add_parser("elastic", help=elastic_command.HELP, description=elastic_command.HELP)
    elastic_command.add_arguments(elastic_parser)
    elastic_parser.set_defaults(handler=elastic_command.run)
    from slipstream.cli import bench as bench_command

    bench_command.add_arguments(commands.add_parser("bench", help=bench_command.HELP, description=bench_command.HELP))
    from slipstream.cli import io_bench as io_command

    io_parser = commands.add_parser("io", help=io_command.HELP, description=io_command.HELP)
    io_command.add_arguments(io_parser)
    io_parser.set_defaults(handler=io_command.run)
    from slipstream.cli import nvme as nvme_command

    nvme_command.add_arguments(commands.add_parser("nvme", help=nvme_command.HELP, description=nvme_command.HELP))
    return parser


def main(argv: list[str] | None = None) -> int:
    from slipstream.cli.run import is_short_form

    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if is_short_form(argv, subcommands=set(SUBCOMMANDS)):
        argv = ["run", *argv]  # DeepSpeed's form: `slipstream [launcher flags] script.py args`
    args = parser.parse_args(argv)
    if getattr(args, "handler", None) is None:
        parser.print_help()
        return 2
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())

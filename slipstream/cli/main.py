"""Entry point of the `slipstream` command: parses the subcommand and hands over to its module."""

from __future__ import annotations

import argparse
import importlib
import sys

from slipstream import __version__

COMMANDS: dict[str, tuple[str, str]] = {
    "report": ("slipstream.report", "environment and native-op report (DeepSpeed's ds_report)"),
    "run": ("slipstream.cli.run", ""),
    "export": ("slipstream.cli.export", ""),
    "plan": ("slipstream.cli.plan", ""),
    "elastic": ("slipstream.cli.elastic", ""),
    "ssh": ("slipstream.cli.ssh", ""),
    "bench": ("slipstream.cli.bench", ""),
    "io": ("slipstream.cli.io_bench", ""),
    "nvme": ("slipstream.cli.nvme", ""),
    "compat": ("slipstream.compat.command", ""),
    "plot": ("slipstream.cli.plot", ""),
}
"""Subcommand -> (the module that owns it, a help line when the module has no HELP). Each module has
`add_arguments(parser)` and either `run(args)` or sets its own handlers (commands with sub-subcommands)."""
SUBCOMMANDS = tuple(COMMANDS)
"""Every subcommand name: a first argument outside this list may be DeepSpeed's short form of `run`."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slipstream", description="Slipstream: ZeRO training with DeepSpeed's API.")
    parser.add_argument("--version", action="version", version=f"slipstream {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, fallback_help) in COMMANDS.items():
        module = importlib.import_module(module_name)
        text = getattr(module, "HELP", fallback_help)
        sub = commands.add_parser(name, help=text, description=text)
        module.add_arguments(sub)
        if hasattr(module, "run"):
            sub.set_defaults(handler=module.run)
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

"""Entry point of the `slipstream` command: parses the subcommand and hands over to its module."""

from __future__ import annotations

import argparse
import sys

from slipstream import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slipstream", description="Slipstream: ZeRO training with DeepSpeed's API.")
    parser.add_argument("--version", action="version", version=f"slipstream {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    from slipstream import report

    report_parser = commands.add_parser("report", help="environment and native-op report (DeepSpeed's ds_report)")
    report.add_arguments(report_parser)
    report_parser.set_defaults(handler=report.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "handler", None) is None:
        parser.print_help()
        return 2
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())

"""`slipstream compat install | uninstall | status | wheel`: the opt-in `deepspeed` compatibility package
(deepspeed_dist.py, docs/deepspeed-compat.md). It lives beside the package it manages; cli/main.py lists it by
module name, so the core command line imports nothing of compat/."""

from __future__ import annotations

import argparse
import json

HELP = "install or inspect the opt-in `deepspeed` compatibility package (import deepspeed -> Slipstream)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="compat_command", metavar="ACTION")
    install = sub.add_parser(
        "install", help="install `deepspeed` (import name, scripts, metadata) mapping to Slipstream"
    )
    install.add_argument("--python", default=None, help="the interpreter whose environment gets it (default: this one)")
    install.set_defaults(handler=_install)
    uninstall = sub.add_parser("uninstall", help="remove the compatibility package (never a real DeepSpeed)")
    uninstall.add_argument("--python", default=None)
    uninstall.set_defaults(handler=_uninstall)
    stat = sub.add_parser("status", help="say what `import deepspeed` gives here")
    stat.add_argument("--json", action="store_true")
    stat.set_defaults(handler=_status)
    wheel = sub.add_parser("wheel", help="write the compatibility wheel into a directory (to install elsewhere)")
    wheel.add_argument("directory")
    wheel.set_defaults(handler=_wheel)


def _install(args: argparse.Namespace) -> int:
    from slipstream.compat import deepspeed_dist

    return deepspeed_dist.install(args.python)


def _uninstall(args: argparse.Namespace) -> int:
    from slipstream.compat import deepspeed_dist

    return deepspeed_dist.uninstall(args.python)


def _status(args: argparse.Namespace) -> int:
    from slipstream.compat import deepspeed_dist

    data = deepspeed_dist.status()
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print(f"deepspeed: {data['state']}")
        for line in data["distributions"]:
            print(f"  {line}")
    return 0


def _wheel(args: argparse.Namespace) -> int:
    from slipstream.compat import deepspeed_dist

    print(deepspeed_dist.build_wheel(args.directory))
    return 0

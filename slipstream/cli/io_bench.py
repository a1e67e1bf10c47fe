"""`slipstream io PATH` (DeepSpeed's ds_io): read and write throughput of the async_io op in a directory, with
the `aio` section's settings as flags; the logic is ops/aio/bench.py. `slipstream nvme tune` (cli/nvme.py)
shares the settings flags and the loading of the op.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slipstream.cli.sizes import format_bytes, parse_bytes, parse_bytes_list, positive_int

if TYPE_CHECKING:
    from slipstream.ops.aio.bench import AioSettings, IoBench, Throughput

HELP = "read and write throughput of the async_io op in a directory (DeepSpeed's ds_io)"


def default_settings() -> AioSettings:
    """The `aio` section's defaults (the schema's values)."""
    from slipstream.config.zero_plans import default_aio_plan

    return default_aio_plan()


def parse_ops(text: str) -> list[str]:
    ops = [op.strip() for op in text.split(",") if op.strip()]
    if not ops or any(op not in ("write", "read") for op in ops):
        raise argparse.ArgumentTypeError(f"{text!r}: expected write, read or write,read")
    return list(dict.fromkeys(ops))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="an existing directory on the drive to measure (files are made and removed)")
    parser.add_argument(
        "--sizes",
        type=parse_bytes_list,
        default=[64 << 20],
        help="bytes per transfer, comma-separated, e.g. 16M,256M (default 64M)",
    )
    parser.add_argument("--ops", type=parse_ops, default=["write", "read"], help="write, read or both (default)")
    parser.add_argument("--loops", type=positive_int, default=5, help="timed transfers per op and size (default 5)")
    add_settings_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")


_SETTINGS_FLAGS: tuple[tuple[str, tuple[str, ...], Any, str], ...] = (
    # (AioPlan field, spellings besides --field-name and --field_name, value type or bool, help)
    ("block_size", (), parse_bytes, "bytes per I/O request"),
    ("queue_depth", (), positive_int, "requests in flight"),
    ("intra_op_parallelism", ("--io_parallel",), positive_int, "threads per operation"),
    ("single_submit", (), bool, "submit requests one at a time"),
    ("overlap_events", (), bool, "overlap submission and completion"),
)
"""The `aio` section's keys as flags; a bool one also gets its --no- form."""


def add_settings_arguments(parser: argparse.ArgumentParser) -> None:
    """The `aio` section as flags, defaulting to the section's defaults (AioPlan: no torch import for --help)."""
    aio = default_settings()
    group = parser.add_argument_group("aio settings (the config's `aio` section; defaults are its defaults)")
    for field, aliases, kind, help_text in _SETTINGS_FLAGS:
        flags = (f"--{field.replace('_', '-')}", f"--{field}", *aliases)
        default = getattr(aio, field)
        if kind is bool:
            group.add_argument(
                *flags, dest=field, action=argparse.BooleanOptionalAction, default=default, help=help_text
            )
        else:
            shown = format_bytes(default) if kind is parse_bytes else default
            group.add_argument(*flags, dest=field, type=kind, default=default, help=f"{help_text} (default {shown})")


def settings_from(args: argparse.Namespace) -> AioSettings:
    from slipstream.config.plan import AioPlan

    return AioPlan(**{field: getattr(args, field) for field, *_ in _SETTINGS_FLAGS})


def check_directory(command: str, path: str) -> str | None:
    """Why `path` cannot be measured (an error line), or None."""
    if not Path(path).is_dir():
        what = "does not exist" if not Path(path).exists() else "is not a directory"
        return (
            f"slipstream {command}: error: {path} {what}; give an existing directory on the drive to measure "
            "(e.g. the nvme_path of your offload config)"
        )
    if not os.access(path, os.W_OK):
        return f"slipstream {command}: error: {path} is not writable; give a directory you can write to"
    return None


def open_bench(command: str, path: str, settings: AioSettings) -> tuple[IoBench, dict[str, str]] | str:
    """The bench on `path` and which implementation runs, or an error line (bad settings, no op)."""
    from slipstream.ops.aio.bench import IoBench, implementation

    bench = IoBench(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the fallback's warning: `implementation` says it in the output
            handle = bench.handle(settings)
    except (ValueError, RuntimeError, OSError) as error:
        return f"slipstream {command}: error: {error}"
    return bench, implementation(handle)


def run(args: argparse.Namespace) -> int:
    from slipstream.ops.aio import AsyncIOError
    from slipstream.ops.aio.bench import direct_io_supported

    problem = check_directory("io", args.path)
    settings = settings_from(args)
    opened = problem or open_bench("io", args.path, settings)
    if isinstance(opened, str):
        print(opened, file=sys.stderr)
        return 2
    bench, implementation = opened
    try:
        results = bench.measure(settings, args.sizes, args.ops, args.loops)
        bad = bench.verify(settings)
        used = bench.reported_settings(settings)
    except AsyncIOError as error:
        print(f"slipstream io: error: {error}", file=sys.stderr)
        return 1
    finally:
        bench.close()
    report = {
        "path": str(Path(args.path).resolve()),
        "o_direct": direct_io_supported(args.path),
        **implementation,
        "aio": used,
        "results": [r.as_dict() for r in results],
    }
    print(json.dumps(report) if args.json else format_report(report, results))
    if bad:
        print(
            f"slipstream io: error: the data read back differs from what was written for size(s) "
            f"{', '.join(format_bytes(n) for n in bad)}: the drive, the file system or the op is faulty",
            file=sys.stderr,
        )
        return 1
    return 0


def format_report(report: dict[str, Any], results: list[Throughput]) -> str:
    direct = "yes" if report["o_direct"] else "no: the figures include the page cache"
    lines = [
        f"async_io: {report['note']}",
        f"path: {report['path']} (O_DIRECT: {direct})",
        "aio: " + ", ".join(f"{k} {str(v).lower()}" for k, v in report["aio"].items()),
        f"{'op':<7}{'size':>11}{'loops':>7}{'GB/s':>9}{'min':>8}{'max':>8}   (median transfer; GB/s = 1e9 B/s)",
    ]
    for result in results:
        row = result.as_dict()
        lines.append(
            f"{row['op']:<7}{format_bytes(row['size_bytes']):>11}{row['loops']:>7}{row['gb_s']:>9.3f}"
            f"{row['min_gb_s']:>8.3f}{row['max_gb_s']:>8.3f}"
        )
    return "\n".join(lines)

"""`slipstream nvme tune PATH` (DeepSpeed's ds_nvme_tune): sweep the `aio` settings in a directory within a time
budget, print the table, say whether the best beats the defaults, and write the recommended `aio` section as
JSON; the logic is ops/aio/tune.py (how it decides: its module doc).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from slipstream.cli.io_bench import check_directory, default_settings, open_bench
from slipstream.cli.sizes import format_bytes, parse_bytes, parse_bytes_list, positive_int

HELP = "NVMe tuning: `tune` sweeps the aio settings on a path and writes the best aio section (ds_nvme_tune)"
TUNE_HELP = (
    "sweep block size, queue depth, intra-op parallelism and overlap on a path within a time budget; "
    "print the table and the recommended `aio` section (DeepSpeed's ds_nvme_tune)"
)


def _int_list(text: str) -> list[int]:
    values = [positive_int(item) for item in text.split(",") if item.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more integers separated by commas, e.g. 4,8,16")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    kinds = parser.add_subparsers(dest="nvme", metavar="ACTION", required=True)
    tune = kinds.add_parser("tune", help=TUNE_HELP, description=TUNE_HELP)
    tune.add_argument("path", help="an existing directory on the drive to tune for (files are made and removed)")
    tune.add_argument(
        "--budget-s",
        "--budget_s",
        dest="budget_s",
        type=float,
        default=30.0,
        help="seconds to spend, about (default 30; at least 8 confirmation pairs are always measured)",
    )
    tune.add_argument("--size", type=parse_bytes, default=64 << 20, help="bytes per transfer (default 64M)")
    tune.add_argument(
        "--block-sizes",
        type=parse_bytes_list,
        default=[256 << 10, 1 << 20, 4 << 20],
        help="block sizes to try (default 256K,1M,4M)",
    )
    tune.add_argument("--queue-depths", type=_int_list, default=[4, 8, 16, 32], help="default 4,8,16,32")
    tune.add_argument(
        "--parallelisms", type=_int_list, default=[1, 2, 4], help="intra_op_parallelism values to try (default 1,2,4)"
    )
    tune.add_argument("--output", "-o", default=None, help='write the recommended {"aio": {...}} section here')
    tune.add_argument("--json", action="store_true", help="print the whole report as one JSON object")
    tune.set_defaults(handler=run_tune)


def run_tune(args: argparse.Namespace) -> int:
    from slipstream.ops.aio import AsyncIOError
    from slipstream.ops.aio.tune import grid, tune

    if not (args.budget_s > 0 and math.isfinite(args.budget_s)):
        print(f"slipstream nvme tune: error: --budget-s {args.budget_s}: expected seconds > 0", file=sys.stderr)
        return 2
    defaults = default_settings()
    opened = check_directory("nvme tune", args.path) or open_bench("nvme tune", args.path, defaults)
    if isinstance(opened, str):
        print(opened, file=sys.stderr)
        return 2
    bench, implementation = opened
    overlap = [True, False] if implementation["kind"] != "fallback" else [defaults.overlap_events]
    settings = grid(
        defaults,
        block_sizes=args.block_sizes,
        queue_depths=args.queue_depths,
        parallelisms=args.parallelisms,
        overlap_events=overlap,
    )
    try:
        report = tune(bench, defaults, settings, args.size, args.budget_s)
    except (AsyncIOError, ValueError) as error:
        print(f"slipstream nvme tune: error: {error}", file=sys.stderr)
        return 2 if isinstance(error, ValueError) else 1
    finally:
        bench.close()
    data = report_json(report, implementation, args.path)
    if args.output:
        Path(args.output).write_text(json.dumps({"aio": data["recommended"]}, indent=2) + "\n")
    print(json.dumps(data) if args.json else format_report(data, args.output))
    return 0


def report_json(report: Any, implementation: dict[str, str], path: str) -> dict[str, Any]:
    from slipstream.ops.aio.bench import as_section

    rows = []
    for candidate in report.candidates:
        rates = {k: (None if math.isnan(v) else v) for k, v in candidate.rates(report.size).items()}
        rows.append(
            {
                **as_section(candidate.settings),
                **rates,
                "cycles": len(candidate.write_s),
                "is_defaults": candidate.settings == report.defaults,
            }
        )
    verdict = report.verdict
    return {
        "path": str(Path(path).resolve()),
        **implementation,
        "size_bytes": report.size,
        "budget_s": report.budget_s,
        "spent_s": report.spent_s,
        "rounds": report.rounds,
        "measured": sum(1 for row in rows if row["cycles"]),
        "candidates": rows,
        "tuned_beats_defaults": verdict.tuned_beats_defaults,
        "verdict": verdict.text,
        "confirmation": {
            "pairs": verdict.pairs,
            "faster_pairs": verdict.faster_pairs,
            "median_gain": verdict.median_gain,
            "p_value": verdict.p_value,
        },
        "defaults": as_section(report.defaults),
        "recommended": as_section(verdict.recommended),
    }


def format_report(data: dict[str, Any], output: str | None) -> str:
    where = (
        f"path: {data['path']}; {format_bytes(data['size_bytes'])} per transfer; {data['measured']} of "
        f"{len(data['candidates'])} settings measured in {data['rounds']} round(s), {data['spent_s']:.1f} s of a "
        f"{data['budget_s']:g} s budget"
    )
    head = (
        f"{'block':>9}{'qd':>5}{'intra':>6}{'overlap':>8}{'write':>8}{'read':>8}{'cycle':>8}{'n':>3}"
        "   (GB/s of the median transfer; cycle: a write + a read)"
    )
    lines = [f"async_io: {data['note']}", where, head]
    for row in data["candidates"]:
        head = (
            f"{format_bytes(row['block_size']):>9}{row['queue_depth']:>5}{row['intra_op_parallelism']:>6}"
            f"{str(row['overlap_events']).lower():>8}"
        )
        if not row["cycles"]:
            lines.append(f"{head}   not measured (budget)")
            continue
        mark = "   <- defaults" if row["is_defaults"] else ""
        lines.append(
            f"{head}{row['write_gb_s']:>8.3f}{row['read_gb_s']:>8.3f}{row['cycle_gb_s']:>8.3f}{row['cycles']:>3}{mark}"
        )
    if data["measured"] < len(data["candidates"]):
        lines.append(f"{len(data['candidates']) - data['measured']} settings were not measured: raise --budget-s")
    lines += [data["verdict"], "aio section: " + json.dumps({"aio": data["recommended"]})]
    if output:
        lines.append(f"written to {output}")
    return "\n".join(lines)

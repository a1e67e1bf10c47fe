"""`slipstream bench comm` (DeepSpeed's ds_bench): time all_reduce, all_gather, reduce_scatter, all_to_all,
broadcast and point-to-point over a range of sizes on the current world; the logic is comm/bench.py.

Start it through the launcher, one process per rank:

    slipstream run --num_gpus 2 --module slipstream.cli.bench comm --sizes 64K,1M,16M

(`python -m slipstream.cli.bench` is this module; it takes the `--local_rank` the launcher passes.) Run as
`slipstream bench comm` without a launcher it is a world of one: the collectives run, but no data crosses
between processes, so a note on stderr says how to launch it. Rank 0 prints the table (or `--json`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import TYPE_CHECKING

from slipstream.cli.sizes import format_bytes, parse_bytes, parse_bytes_list, positive_int

if TYPE_CHECKING:
    from slipstream.comm.bench import CommResult

HELP = "benchmarks: `comm` times the collectives on the current world (DeepSpeed's ds_bench)"
COMM_HELP = (
    "time all_reduce, all_gather, reduce_scatter, all_to_all, broadcast and send/recv over a range "
    "of sizes: time, algorithm and bus bandwidth (DeepSpeed's ds_bench)"
)
LAUNCH = "slipstream run --num_gpus N --module slipstream.cli.bench comm [flags]"
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "p2p")  # comm/bench.py's OPS
DTYPES = ("float32", "float16", "bfloat16")


def parse_ops(text: str) -> list[str]:
    ops = [op.strip().replace("-", "_") for op in text.split(",") if op.strip()]
    unknown = [op for op in ops if op not in OPS]
    if unknown or not ops:
        raise argparse.ArgumentTypeError(
            f"{text!r}: unknown op(s) {', '.join(unknown) or '(none given)'}; choose from {','.join(OPS)}"
        )
    return ops


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    kinds = parser.add_subparsers(dest="bench", metavar="BENCH", required=True)
    comm = kinds.add_parser("comm", help=COMM_HELP, description=f"{COMM_HELP}. Launch: {LAUNCH}")
    add_comm_arguments(comm)
    comm.set_defaults(handler=run_comm)


def add_comm_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ops", type=parse_ops, default=list(OPS), help=f"comma-separated, default {','.join(OPS)}")
    parser.add_argument(
        "--sizes",
        type=parse_bytes_list,
        default=None,
        help="comma-separated message sizes, e.g. 64K,1M,16M (K/M/G are powers of 2; the default)",
    )
    parser.add_argument("--scan", action="store_true", help="every power of 2 from 1K to --maxsize instead of --sizes")
    parser.add_argument("--maxsize", type=parse_bytes, default=1 << 24, help="largest size of --scan (default 16M)")
    parser.add_argument("--trials", type=positive_int, default=20, help="timed calls per size (default 20)")
    parser.add_argument("--warmups", type=int, default=3, help="untimed calls before them (default 3)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="element type (default float32)")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")


def sizes_of(args: argparse.Namespace) -> list[int]:
    if args.scan:
        return [1 << p for p in range(10, max(10, args.maxsize.bit_length() - 1) + 1)]
    return list(args.sizes or [64 << 10, 1 << 20, 16 << 20])


def _launched() -> bool:
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def run_comm(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from slipstream.comm import bench as comm_bench
    from slipstream.comm import init_distributed, is_initialized

    if args.warmups < 0:
        print(f"slipstream bench comm: error: --warmups {args.warmups}: expected 0 or more", file=sys.stderr)
        return 2
    alone = not is_initialized() and not _launched()
    try:
        init_distributed(verbose=False)
    except (RuntimeError, ValueError) as error:
        print(f"slipstream bench comm: error: {error}; launch it with `{LAUNCH}`", file=sys.stderr)
        return 2
    if alone:
        print(
            "slipstream bench comm: note: no launcher environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), "
            f"so this is a world of one and no data crosses between processes; to measure N ranks: `{LAUNCH}`",
            file=sys.stderr,
        )
    results = comm_bench.run(
        args.ops, sizes_of(args), trials=args.trials, warmups=args.warmups, dtype=getattr(torch, args.dtype)
    )
    if dist.get_rank() == 0:
        header = {
            "world_size": dist.get_world_size(),
            "backend": str(dist.get_backend()),
            "dtype": args.dtype,
            "trials": args.trials,
            "warmups": args.warmups,
        }
        if args.json:
            print(json.dumps({**header, "results": [_json_row(r.as_dict()) for r in results]}), flush=True)
        else:
            print(format_table(header, results), flush=True)
    return 0


def _json_row(row: dict[str, object]) -> dict[str, object]:
    """NaN (an unsupported op's figures) is not JSON: null instead."""
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()}


def format_table(header: dict[str, object], results: list[CommResult]) -> str:
    title = (
        f"world size {header['world_size']} ({header['backend']}), {header['dtype']}, {header['trials']} timed "
        f"calls after {header['warmups']} warmups per size; time: the median call (its slowest rank); "
        "GB/s = 1e9 B/s"
    )
    lines = [title, f"{'op':<15}{'size':>11}{'elements':>12}{'time (us)':>12}{'algbw (GB/s)':>14}{'busbw (GB/s)':>14}"]
    for r in results:
        head = f"{r.op:<15}{format_bytes(r.size_bytes):>11}{r.elements:>12}"
        if r.unsupported:
            lines.append(f"{head}   unsupported: {r.unsupported}")
        else:
            lines.append(f"{head}{r.time_s * 1e6:>12.1f}{r.algbw_gb_s:>14.3f}{r.busbw_gb_s:>14.3f}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slipstream bench", description=HELP)
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """`python -m slipstream.cli.bench comm ...`: the entry `slipstream run --module` starts on every rank."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    return int(args.handler(args))


if __name__ == "__main__":
    sys.exit(main())

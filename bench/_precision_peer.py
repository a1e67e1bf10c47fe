"""DeepSpeed's rows of bench/precision.py; runs only in the peer environment (.bench-venv), never imported.

    .bench-venv/bin/python bench/_precision_peer.py ARGS_JSON

Trains every requested row at every requested stage with `deepspeed.initialize` and the same JSON config,
model, data and timing as Slipstream's rows (bench/_precision_rows.py), on two spawned gloo ranks, and
prints rank 0's results as one JSON line. Nothing here imports slipstream.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _precision_rows import time_row
from _two_ranks import run_two_ranks


def measure(args: argparse.Namespace) -> dict[str, dict]:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update({"LOCAL_RANK": str(rank), "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)})
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    results = {}
    for stage in args.stages:
        for row in args.rows:
            try:
                results[f"{stage}:{row}"] = time_row(
                    deepspeed.initialize, row, stage, layers=args.layers, width=args.width, steps=args.steps
                )
            except Exception as error:  # a configuration DeepSpeed refuses is a row without numbers
                results[f"{stage}:{row}"] = {"error": f"{type(error).__name__}: {error}"[:160]}
    return results


def main() -> None:
    """Rank 0's results as one JSON line; DeepSpeed's shared-memory all-reduce buffers (named after
    MASTER_ADDR and MASTER_PORT, which must be set) are removed afterwards."""
    try:
        print(json.dumps(run_two_ranks(measure, argparse.Namespace(**json.loads(sys.argv[1])))))
    finally:
        for leftover in Path("/dev/shm").glob(
            f"deepspeed_allreduce_buffer_*_{os.environ['MASTER_ADDR']}_{os.environ['MASTER_PORT']}_*"
        ):
            leftover.unlink(missing_ok=True)


if __name__ == "__main__":
    main()

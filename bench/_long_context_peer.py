"""DeepSpeed's side of bench/long_context.py; runs only in the peer environment (.bench-venv), never imported.

    .bench-venv/bin/python bench/_long_context_peer.py [--quick] [--budget-mib 12]

The one-rank tiled row under DeepSpeed's own ALST classes (`deepspeed.runtime.sequence_parallel.ulysses_sp`'s
`TiledMLP` and `TiledFusedLogitsLoss`, `deepspeed.checkpointing.checkpoint` per layer) on the same decoder,
budget and search as bench/long_context.py's `checkpointing+tiled` row, beside that row with Slipstream's
classes in the same process. The search and the counting are bench/long_context.py's (its counter is a torch
dispatch mode, `slipstream.profiling.live_tensors`); only the classes under test differ.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # slipstream, for the search and its counter

import torch
from _long_context_model import Kit, Model, batch
from long_context import FULL, QUICK, Args, longest, recompute

from slipstream.sequence.tiled import TiledFusedLogitsLoss, TiledMLP


def _deepspeed_kit() -> Kit:
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss as DsLoss
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP as DsMLP

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    return Kit(checkpoint=deepspeed.checkpointing.checkpoint, tiled_mlp=DsMLP, tiled_loss=DsLoss)


def _step_s(model: Model, args: Args) -> float:
    tokens, targets = batch(args.dims, args.common)
    times = []
    for _ in range(args.steps + 1):
        started = time.perf_counter()
        model(tokens, targets).backward()
        model.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="bench/long_context.py's smaller model and budget")
    parser.add_argument("--budget-mib", type=float, default=None, help="memory (default 48, quick 12)")
    options = parser.parse_args()
    budget = int((options.budget_mib or (12 if options.quick else 48)) * 2**20)
    args = Args(dims=QUICK if options.quick else FULL, budget=budget, common=512 if options.quick else 1024, steps=2)
    recompute.configure(None, checkpoint_in_cpu=False)
    kits = {
        "slipstream": Kit(checkpoint=recompute.checkpoint, tiled_mlp=TiledMLP, tiled_loss=TiledFusedLogitsLoss),
        "deepspeed": _deepspeed_kit(),
    }
    print(f"checkpointing+tiled at 1 rank, budget {budget / 2**20:.0f} MiB")
    print(f"{'classes':12} {'longest':>8} {'step s @' + str(args.common):>12}")
    for name, kit in kits.items():
        torch.manual_seed(0)
        model = Model(args.dims, kit)
        found, _ = longest(model, "checkpointing+tiled", args, 1)
        print(f"{name:12} {found:>8} {_step_s(model, args):>12.3f}")


if __name__ == "__main__":
    main()

"""What the two-rank benchmarks that build their own engines share: the Linear + ReLU stack they train and the
spawned pair of gloo ranks that runs them (FileStore rendezvous in a temp dir, results back as JSON)."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

RankFn = Callable[[object], dict]


def make_mlp(layers: int, width: int) -> nn.Module:
    """`layers` x (Linear(width, width), ReLU), seeded alike on every rank."""
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks)


def _rank_main(rank: int, world: int, store_path: str, fn: RankFn, args: object, out: str) -> None:
    os.environ.setdefault("SLIPSTREAM_LOG_LEVEL", "warning")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        results = fn(args)
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def run_two_ranks(fn: RankFn, args: object, *, world: int = 2) -> dict:
    """`fn(args)` on `world` (two unless told) spawned gloo ranks (a module-level function); rank 0's result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        mp.start_processes(
            _rank_main,
            args=(world, os.path.join(tmp, "store"), fn, args, out),
            nprocs=world,
            start_method="spawn",
            join=True,
        )
        return json.loads(Path(out).read_text())

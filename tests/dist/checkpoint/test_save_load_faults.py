"""Faults at world size 2 (refused checkpoints, a full disk), in one spawn.

- Stage 3 (each rank holds half of each tensor): a checkpoint of a bigger layer is refused on both ranks
  with the same message, and the ranks stay in step (no rank waits in a collective).
- One rank's disk fills during a save (simulated on rank 1: its writer raises ENOSPC after part of the file,
  as a real full disk does; the real full disk is tests/compat/test_checkpoint_disk_full.py): rank 1 names its
  file, rank 0 names rank 1 at once instead of waiting out the collective timeout, the unfinished save is
  removed, `latest` is unchanged, and the next save succeeds.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tests.harness import run_distributed


def _engine(out_features: int) -> Any:
    import slipstream

    config = {"train_micro_batch_size_per_gpu": 2, "collective_timeout": 30,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = slipstream.initialize(model=nn.Sequential(nn.Linear(64, out_features)), config=config)
    engine.backward(engine(torch.randn(2, 64)).sum())
    engine.step()
    return engine


def _refused_load(rank: int, root: Path) -> str:
    from slipstream.checkpoint.errors import CheckpointError

    engine = _engine(16)
    engine.save_checkpoint(root, tag="big")
    engine.destroy()
    engine = _engine(8)
    try:
        engine.load_checkpoint(root, tag="big")
        message = "loaded"
    except CheckpointError as exc:
        message = str(exc)
    engine.destroy()
    return message


def _full_disk_on_rank1(rank: int, root: Path) -> dict[str, Any]:
    from slipstream.checkpoint import read_latest
    from slipstream.checkpoint.errors import CheckpointError
    from slipstream.checkpoint.safetensors_io import SafetensorsWriter

    engine = _engine(8)
    engine.save_checkpoint(root, tag="before")
    original = SafetensorsWriter._emit

    def emit_until_full(self: SafetensorsWriter, data: memoryview) -> None:
        if self.bytes_written > 1000:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        original(self, data[:2000])

    out: dict[str, Any] = {}
    if rank == 1:
        SafetensorsWriter._emit = emit_until_full  # type: ignore[method-assign]
    start = time.monotonic()
    try:
        engine.save_checkpoint(root, tag="full")
        out["error"] = None
    except CheckpointError as exc:
        out["error"] = str(exc)
    finally:
        SafetensorsWriter._emit = original  # type: ignore[method-assign]
    out["seconds"] = time.monotonic() - start
    engine.save_checkpoint(root, tag="after")  # both ranks go on together
    out["listing"] = sorted(p.name for p in root.iterdir())
    out["latest"] = read_latest(root)
    engine.destroy()
    return out


def faults(rank: int, world: int, *, root: str) -> dict[str, Any]:
    return {"load": _refused_load(rank, Path(root) / "load"), "disk": _full_disk_on_rank1(rank, Path(root) / "disk")}


def test_faults_at_world_size_two(tmp_path: Path) -> None:
    results = run_distributed(faults, world_size=2, tmp_dir=tmp_path / "run", root=str(tmp_path), timeout_s=120)
    loads = [r["load"] for r in results]
    assert loads[0] == loads[1], loads  # the same verdict on both ranks
    assert "module/0.weight: the checkpoint has shape [16, 64] fp32, the model's parameter '0.weight' has shape " \
           "[8, 64]" in loads[0], loads[0]
    rank0, rank1 = results[0]["disk"], results[1]["disk"]
    assert rank1["error"] is not None and "rank_00001.safetensors needs" in rank1["error"], rank1["error"]
    assert f"{tmp_path}/disk/full" in rank1["error"] and "bytes free" in rank1["error"], rank1["error"]
    assert rank0["error"] is not None and "rank(s) [1] failed while writing its files" in rank0["error"], rank0
    assert rank0["seconds"] < 10 and rank1["seconds"] < 10, (rank0["seconds"], rank1["seconds"])  # timeout is 30
    assert rank0["listing"] == ["after", "before", "latest"], rank0["listing"]  # no .tmp-full, no "full"
    assert rank0["latest"] == "after"

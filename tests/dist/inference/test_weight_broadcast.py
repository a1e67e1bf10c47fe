"""`broadcast_full_weights` hands a ZeRO-3 model to a generator process outside the training world: 2 gloo
training ranks, and a third process (spawned by rank 0, sharing a gloo group with it through a store of its own)
that ends with exactly the state dict the engine's `iter_full_weights` gives, dtypes and shapes included.
The bucket limit makes one tensor travel alone and the rest share buckets (fewer buckets than tensors), and
a second hand-off after a training step delivers the new values through the same buffers."""

from __future__ import annotations

import datetime
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from tests.harness import run_distributed

BUCKET_BYTES = 300  # the first weight (16 x 8 fp32, 512 bytes) travels alone, the rest share buckets


def _group(store_path: str, rank: int) -> dist.ProcessGroup:
    store = dist.FileStore(store_path, 2)
    return dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=60))


def generator(store_path: str, out: str) -> None:
    from slipstream.zero import receive_full_weights

    group = _group(store_path, 1)
    for round_ in range(2):
        torch.save(dict(receive_full_weights(group, src=0)), f"{out}.{round_}")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4), nn.ReLU(), nn.Linear(4, 4))


def rank_fn(rank: int, world: int, *, folder: str) -> None:
    import slipstream
    from slipstream.zero import broadcast_full_weights

    store, out = str(Path(folder) / "handoff-store"), str(Path(folder) / "received")
    process = mp.get_context("spawn").Process(target=generator, args=(store, out)) if rank == 0 else None
    if process is not None:
        process.start()
    group = _group(store, 0) if rank == 0 else None
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = slipstream.initialize(model=_model(), config=config)
    expected = []
    for round_ in range(2):
        x = torch.randn(1, 8, generator=torch.Generator().manual_seed(rank + round_))
        engine.backward(engine(x).square().sum())
        engine.step()
        buckets = broadcast_full_weights(engine, group, src=0, bucket_bytes=BUCKET_BYTES)
        expected.append({name: value.clone() for name, value in engine.iter_full_weights()})
        assert buckets == (4 if rank == 0 else 0), buckets  # 6 tensors in 4 buckets, the first weight alone
    if process is None:
        return
    process.join(timeout=120)
    assert process.exitcode == 0, f"the generator process exited with {process.exitcode}"
    for round_, want in enumerate(expected):
        got = torch.load(f"{out}.{round_}")
        assert list(got) == list(want), (list(got), list(want))
        for name, value in want.items():
            assert got[name].dtype == value.dtype and torch.equal(got[name], value), f"round {round_}: {name}"


def test_broadcast_full_weights_to_a_generator_process(tmp_path) -> None:  # type: ignore[no-untyped-def]
    run_distributed(rank_fn, world_size=2, tmp_dir=tmp_path, timeout_s=180, folder=str(tmp_path))

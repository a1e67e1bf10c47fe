"""A rank that skips a step makes the others fail fast with an error that names it, instead of hanging."""

from __future__ import annotations

import time

from tests.harness import run_distributed
from tests.harness.models import TinyMLP


def skip_a_step(rank: int, world: int) -> str:
    import slipstream
    from slipstream.comm import CollectiveTimeout

    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 1}, "collective_timeout": 3}
    engine, *_ = slipstream.initialize(model=TinyMLP(), config=config)
    try:
        for step in range(3):
            if rank == 1 and step == 2:
                time.sleep(8)  # rank 1 skips the last forward/backward/step, then leaves
                return "skipped"
            x, y = TinyMLP().make_batch(seed=step, batch_size=4)
            engine.backward(TinyMLP.loss(engine(x), y))
            engine.step()
    except CollectiveTimeout as exc:
        return f"{exc.op} #{exc.seq} missing={exc.missing} arrived={exc.arrived} | {exc}"
    return "no error"


def test_missing_rank_is_named_within_the_timeout(tmp_path) -> None:  # type: ignore[no-untyped-def]
    started = time.monotonic()
    rank0, rank1 = run_distributed(skip_a_step, world_size=2, tmp_dir=tmp_path, timeout_s=60)
    assert rank1 == "skipped"
    assert "missing=[1] arrived=[0]" in rank0, rank0
    assert rank0.startswith("reduce_scatter #"), rank0
    assert "rank 1 last reached #" in rank0 and "within 3 s" in rank0
    assert time.monotonic() - started < 40

"""A rank that skips a step makes the others fail fast with an error that names it, instead of hanging; the
config's collective_timeout is the process group's own timeout too, even for a group created before it."""

from __future__ import annotations

import re
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
    rank0, rank1 = run_distributed(skip_a_step, world_size=2, tmp_dir=tmp_path, timeout_s=60)
    assert rank1 == "skipped"
    assert "missing=[1] arrived=[0]" in rank0, rank0
    assert rank0.startswith("reduce_scatter #"), rank0
    assert "rank 1 last reached #" in rank0 and "within 3 s" in rank0
    # a CollectiveTimeout (not PeerLost) means the deadline fired before rank 1 left; the wait it reports says when
    assert float(re.search(r" after (\d+\.\d) s ", rank0).group(1)) < 8, rank0  # type: ignore[union-attr]


GROUP_TIMEOUT_S = 3
PEER_SLEEP_S = 15  # rank 1 stays away this long; the group gave up long before if it got the config's timeout


def own_collective_times_out(rank: int, world: int) -> object:
    import torch
    import torch.distributed as dist

    import slipstream

    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 2}, "collective_timeout": GROUP_TIMEOUT_S}
    slipstream.initialize(model=TinyMLP(), config=config)  # the harness created the group, with 60 s
    if rank == 1:
        time.sleep(PEER_SLEEP_S)
        return "slept"
    started = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))  # the script's own collective: only the group's timeout guards it
    except RuntimeError as exc:
        return (time.monotonic() - started, str(exc)[:200])
    return "no error"


def test_the_config_timeout_reaches_a_group_created_before_it(tmp_path) -> None:  # type: ignore[no-untyped-def]
    rank0, rank1 = run_distributed(own_collective_times_out, world_size=2, tmp_dir=tmp_path, timeout_s=60)
    assert rank1 == "slept"
    assert isinstance(rank0, tuple), rank0
    elapsed, message = rank0
    # gloo gave up before rank 1 came back (without the config's timeout the all_reduce would have completed
    # when it did, or failed only at the harness's 60 s); how long before depends on the machine's load
    assert elapsed < PEER_SLEEP_S, (elapsed, message)
    assert "Timed out" in message or "timed out" in message, message


DEADLINE_S = 2


def reduce_scatter_alone(rank: int, world: int) -> object:
    import datetime

    import torch
    import torch.distributed as dist

    from slipstream.comm import CollectiveTimeout, collectives

    collectives.set_collective_timeout(DEADLINE_S)
    dist.group.WORLD.set_timeout(datetime.timedelta(seconds=60))  # the backend alone would wait this long
    if rank == 1:
        time.sleep(PEER_SLEEP_S)
        return "slept"
    started = time.monotonic()
    try:
        collectives.reduce_scatter(torch.zeros(2), torch.ones(4))
    except CollectiveTimeout as exc:
        return (time.monotonic() - started, str(exc))
    return "no error"


def test_slipstream_keeps_its_own_deadline_for_a_reduce_scatter(tmp_path) -> None:  # type: ignore[no-untyped-def]
    rank0, rank1 = run_distributed(reduce_scatter_alone, world_size=2, tmp_dir=tmp_path, timeout_s=60)
    assert rank1 == "slept" and isinstance(rank0, tuple), rank0
    elapsed, message = rank0
    # Slipstream's deadline ended the wait before rank 1 came back (gloo's own reduce-scatter work ignores
    # wait(timeout): without the deadline it would have waited for the peer); the message names the 2 s deadline
    assert elapsed < PEER_SLEEP_S, (elapsed, message)
    assert "reduce_scatter #" in message and "did not complete within 2 s" in message and "missing ranks [1]" in message

"""MiCS' hierarchical all-gather (`mics_hierarchical_params_gather`, zero/stage3/hierarchical_gather.py) at 4 ranks
as 2 "nodes" x 2 (LOCAL_WORLD_SIZE=2) with mics_shard_size 4 (the shard group spans both nodes).

It moves the rows the plain gather moves, so after two AdamW steps the parameters and losses equal the plain MiCS
run's bit for bit. Its bytes, counted per process group over one forward and backward: every gather is an
all-gather across nodes over this rank's column {l, l + 2} of 2 rows (each rank sends its own row across once)
and one inside the node of 4 rows; nothing is gathered over all 4 ranks. Against the plain run's gathers over all 4
(4 rows each): the column's bytes are half of them, the node's equal to them. A shard group inside one node
(mics_shard_size 2) is refused, naming the key, as DeepSpeed refuses it. The same spawn runs LoCo's reducer
case at 2 x 2 (test_loco.py).
"""

from __future__ import annotations

import os

import torch

from tests.dist.zero.test_loco import check_reducer, reducer_case
from tests.harness import run_distributed
from tests.harness.models import TinyMLP

MICRO, STEPS, HIDDEN = 4, 2, 40
NODES = [(0, 1), (2, 3)]


def _engine(**zero: object):  # type: ignore[no-untyped-def]
    import slipstream

    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero},
    }
    engine, *_ = slipstream.initialize(model=TinyMLP(hidden=HIDDEN), config=config)
    return engine


def _train(rank: int, hierarchical: bool) -> dict:
    from slipstream.comm import count_collectives

    engine = _engine(mics_shard_size=4, mics_hierarchical_params_gather=hierarchical)
    losses, gathered = [], {}
    for step in range(STEPS):
        x, y = TinyMLP(hidden=HIDDEN).make_batch(seed=10 * step + rank, batch_size=MICRO)
        with count_collectives() as counter:
            loss = TinyMLP.loss(engine(x), y)
            engine.backward(loss)
        if step == 0:
            gathered = {ranks: n for (op, ranks), n in counter.group_bytes.items() if op == "all_gather"}
        engine.step()
        losses.append(float(loss.detach()))
    out = {"losses": losses, "params": engine.zero_model.full_state(only_rank0=False), "gathered": gathered}
    engine.destroy()
    return out


def four_ranks(rank: int, world: int) -> dict:
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # 2 "nodes" x 2, before any group is built
    out: dict = {"plain": _train(rank, False), "hierarchical": _train(rank, True)}
    try:
        _engine(mics_shard_size=2, mics_hierarchical_params_gather=True).destroy()
        out["inside_one_node"] = None
    except ValueError as error:
        out["inside_one_node"] = str(error)
    out["loco"] = reducer_case(rank, world)
    return out


def test_hierarchical_gather_equals_plain_mics_and_crosses_nodes_once(tmp_path) -> None:  # type: ignore[no-untyped-def]
    results = run_distributed(four_ranks, world_size=4, tmp_dir=tmp_path, timeout_s=300)
    for rank, result in enumerate(results):
        plain, hierarchical = result["plain"], result["hierarchical"]
        assert hierarchical["losses"] == plain["losses"], (rank, hierarchical["losses"], plain["losses"])
        for name, value in plain["params"].items():
            assert torch.equal(hierarchical["params"][name], value), f"rank {rank}: {name} differs from plain MiCS"
        column, node = (rank % 2, rank % 2 + 2), NODES[rank // 2]
        whole = plain["gathered"][(0, 1, 2, 3)]
        assert set(plain["gathered"]) == {(0, 1, 2, 3)}, plain["gathered"]
        assert hierarchical["gathered"] == {column: whole // 2, node: whole}, (rank, hierarchical["gathered"], whole)
        message = result["inside_one_node"]
        assert message is not None and "mics_hierarchical_params_gather" in message and "one node" in message
    check_reducer(4, 2, [r["loco"] for r in results])

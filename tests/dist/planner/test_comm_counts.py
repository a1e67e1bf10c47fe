"""The cluster communication model (planner/comm_model.py) against the collectives the engine issues on two gloo
ranks, counted by `slipstream.comm`: per phase (forward, backward, after the step) and per collective, the bytes
of the buffers (what the counter records: the gathered output, the reduce-scatter's input) at ZeRO-2, ZeRO-3
and ZeRO-3 with quantized weights (qwZ). The model counts no padding, so the counts may exceed it by the padding:
at most world x 8 bytes per unit (sharding padding and the stage-3 gather's unit tag), plus world x a quantization
block's 256 bytes per unit with qwZ. The optimizer's own scalars (the overflow and norm all-reduces) are not
communication of the layout and are left out. One spawn, one step per case."""

from __future__ import annotations

import torch

from tests.harness import run_distributed, run_subtests
from tests.harness.models import TinyMLP

CASES = [{"stage": 2, "qwz": False}, {"stage": 3, "qwz": False}, {"stage": 3, "qwz": True}]
UNITS = 3  # TinyMLP's layers: one stage-3 unit each (persistence threshold 0)


def counted_step(rank: int, world: int, *, stage: int, qwz: bool) -> dict:
    import slipstream
    from slipstream.comm import count_collectives

    model = TinyMLP(hidden=300)
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0, "zero_quantized_weights": qwz}
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, "zero_optimization": zero}
    engine, *_ = slipstream.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), config=config
    )
    x, y = TinyMLP(hidden=300).make_batch(seed=rank, batch_size=4)
    phases = {}
    with count_collectives() as phases["forward"]:
        loss = TinyMLP.loss(engine(x), y)
    with count_collectives() as phases["backward"]:
        engine.backward(loss)
    with count_collectives() as phases["step"]:
        engine.step()
    engine.destroy()
    return {phase: {op: n for op, n in c.bytes.items() if op != "all_reduce"} for phase, c in phases.items()}


def grid(rank: int, world: int) -> list[dict]:
    return run_subtests(CASES, lambda **case: counted_step(rank, world, **case))


def test_modelled_buffers_match_the_counted_collectives(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from slipstream.planner.cluster import Cluster
    from slipstream.planner.comm_model import Variant, transfers

    world = 2
    numel = sum(p.numel() for p in TinyMLP(hidden=300).parameters())
    cluster = Cluster(nodes=1, gpus_per_node=world, intra_bandwidth=1e9, inter_bandwidth=1e9, flops=1e12)
    results = run_distributed(grid, world_size=world, tmp_dir=tmp_path)
    for case, counted in zip(CASES, results[0]):
        variant = Variant(name="case", stage=case["stage"], qwz=case["qwz"])
        modelled: dict[str, dict[str, float]] = {"forward": {}, "backward": {}, "step": {}}
        for t in transfers(variant, numel=numel, param_bytes=4, grad_bytes=4, cluster=cluster):
            modelled[t.phase][t.op] = modelled[t.phase].get(t.op, 0.0) + t.buffer
        padding = world * UNITS * (8 + (256 if case["qwz"] else 0))
        assert {p: set(ops) for p, ops in counted.items()} == {p: set(ops) for p, ops in modelled.items()}, case
        for phase, ops in modelled.items():
            for op, expected in ops.items():
                got = counted[phase][op]
                assert 0 <= got - expected <= padding, f"{case} {phase} {op}: counted {got}, modelled {expected}"

"""bench/comm.py's ZeRO++ table: the bytes one stage-3 step sends inside and across "nodes" at 4 ranks simulated
as 2 nodes x 2 (LOCAL_WORLD_SIZE=2), plain and with qwZ, qgZ, both, and with hpZ where the build has it.

Every collective of the step is counted by `slipstream.comm` (its whole buffer) with the function that issued it.
What one rank sends in each tier follows from the group it ran on, as planner/comm_model.py splits it: qgZ's
exchange inside the node and its exchange across nodes (zero/stage3/quantized_reduce.py) and hpZ's gathers
inside the node are one tier each; every other collective runs over all 4 ranks and is split hierarchically
(`hierarchical`). The planner's prediction for the same layout is printed beside the measurement.
"""

from __future__ import annotations

import argparse
import functools
import os

import torch
from _two_ranks import make_mlp

PER_NODE, NODES = 2, 2
ROWS = {
    "plain": {},
    "qwZ": {"zero_quantized_weights": True},
    "qgZ": {"zero_quantized_gradients": True},
    "qwZ+qgZ": {"zero_quantized_weights": True, "zero_quantized_gradients": True},
    "qwZ+qgZ+hpZ": {"zero_quantized_weights": True, "zero_quantized_gradients": True, "zero_hpz_partition_size": 2},
}
INSIDE = ("(_within_node)", "secondary.py")  # qgZ's int4 exchange, hpZ's gathers
ACROSS = ("(_across_nodes)",)  # qgZ's int8 exchange


def rows_built() -> dict[str, dict[str, object]]:
    """The rows whose keys this build honours (hpZ's only once `zero_hpz_partition_size` is implemented)."""
    from slipstream.config.schema.zero import ZeroConfig

    return {name: zero for name, zero in ROWS.items() if all(key in ZeroConfig.IMPLEMENTED for key in zero)}


def _count(sent: dict[str, float], op: str, size: int, site: str) -> None:
    """Add one collective's buffer and what this rank sends of it inside and across nodes to `sent`."""
    from slipstream.planner.comm_model import hierarchical

    if any(mark in site for mark in INSIDE):
        group = (PER_NODE, 1)
    elif any(mark in site for mark in ACROSS):
        group = (1, NODES)
    else:
        group = (PER_NODE, NODES)
    inside, across = hierarchical(op, size, group)
    sent["buffers"] += size
    sent["inside"] += inside
    sent["across"] += across


def measure(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """On each of the 4 ranks: one warm-up step, then one counted step per row; rank 0's bytes."""
    import slipstream
    from slipstream.comm import count_collectives

    os.environ["LOCAL_WORLD_SIZE"] = str(PER_NODE)  # before any group is built
    out = {}
    for name, extra in rows_built().items():
        zero = {"stage": 3, "stage3_param_persistence_threshold": 0, **extra}
        config = {
            "train_micro_batch_size_per_gpu": 4,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": zero,
        }
        engine, _, _, _ = slipstream.initialize(model=make_mlp(args.zeropp_layers, args.width), config=config)
        sent = {"buffers": 0.0, "inside": 0.0, "across": 0.0}

        for step in range(2):
            x = torch.randn(4, args.width)
            with count_collectives() as counter:
                counter.listener = functools.partial(_count, sent) if step == 1 else None
                engine.backward(engine(x).float().pow(2).mean())  # type: ignore[operator]
                engine.step()  # type: ignore[attr-defined]
        engine.destroy()  # type: ignore[attr-defined]
        out[name] = sent
    return out


def predicted(name: str, numel: int) -> tuple[float, float]:
    """The planner's (inside, across) bytes per rank for the row on a 2 x 2 cluster (fp32 parameters)."""
    from slipstream.planner.cluster import Cluster
    from slipstream.planner.comm_model import Variant, transfers

    zero = ROWS[name]
    variant = Variant(
        name=name,
        stage=3,
        qwz="zero_quantized_weights" in zero,
        qgz="zero_quantized_gradients" in zero,
        hpz=int(zero.get("zero_hpz_partition_size", 1)),
    )  # type: ignore[call-overload]
    cluster = Cluster(nodes=NODES, gpus_per_node=PER_NODE, intra_bandwidth=1e9, inter_bandwidth=1e9, flops=1e12)
    moves = transfers(variant, numel=numel, param_bytes=4, grad_bytes=4, cluster=cluster)
    return sum(t.intra for t in moves), sum(t.inter for t in moves)


def report(results: dict[str, dict[str, float]], args: argparse.Namespace) -> None:
    numel = args.zeropp_layers * (args.width * args.width + args.width)
    print(
        f"ZeRO++ at stage 3: {args.zeropp_layers} x Linear({args.width}, {args.width}) ({numel / 1e6:.1f}M "
        f"params), 4 ranks as {NODES} nodes x {PER_NODE}, one step; MiB one rank sends"
    )
    print(
        f"{'layout':<13} {'buffers':>9} {'inside':>9} {'across':>9} {'vs plain':>9} {'model across':>13} "
        f"{'vs plain':>9}"
    )
    plain, plain_model = results["plain"]["across"], predicted("plain", numel)[1]
    for name, sent in results.items():
        model = predicted(name, numel)[1]
        print(
            f"{name:<13} {sent['buffers'] / 2**20:>9.2f} {sent['inside'] / 2**20:>9.2f} "
            f"{sent['across'] / 2**20:>9.2f} {sent['across'] / plain:>8.3f}x {model / 2**20:>13.2f} "
            f"{model / plain_model:>8.3f}x"
        )

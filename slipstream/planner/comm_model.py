"""What each ZeRO layout sends per optimizer step on a cluster, how long it takes, and how much of it hides.

Owns the collective cost model of `slipstream plan --cluster`. Per rank and per collective over a buffer of B
bytes (the whole tensor, what `slipstream.comm`'s counter records) on a group of `a` ranks per node x `b` nodes,
collectives are hierarchical (intra-node ring, then inter-node ring; an all-gather runs the other way round):
    reduce-scatter, all-gather:  intra = (a - 1) / a x B          inter = (b - 1) / b x B / a
    all-reduce:                  twice both (a reduce-scatter then an all-gather)
which sums to the ring's (n - 1) / n x B for n = a x b. A phase takes intra / intra_bandwidth + inter /
(node bandwidth / gpus_per_node): every GPU of a node crosses at once, so they share the node's network.
Latency is left out (large buffers). Quantized traffic is `bits / 8` bytes per element plus one fp32 scale per
block of 256 (zero/quantized.py). qgZ is two all-to-alls (zero/stage3/quantized_reduce.py): an int4 copy of the
gradients inside each node, then an int8 copy of each rank's 1 / a of its node's sum across nodes. Compute per
micro step is 6 x params x tokens / (flops x mfu), a third in the forward, two thirds in the backward; a phase's
communication hides behind its compute up to that compute.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from slipstream.planner.cluster import Cluster

QUANT_BLOCK = 256


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Variant:
    """A ZeRO layout: `stage`, ZeRO++'s qwZ (int8 weight gathers), qgZ (int4/int8 gradient reduce-scatter) and
    hpZ (`hpz` ranks hold a secondary copy; 1: off), or MiCS (`mics` ranks per shard group; 0: off)."""

    name: str
    stage: int
    qwz: bool = False
    qgz: bool = False
    hpz: int = 1
    mics: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Transfer:
    """One collective of one micro step (`per_micro`) or of the step: the bytes this rank sends in each tier."""

    what: str
    phase: str
    """"forward", "backward" or "step" (after the optimizer step)."""
    op: str
    buffer: float
    intra: float
    inter: float
    seconds: float
    per_micro: bool = True


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StepModel:
    variant: Variant
    transfers: tuple[Transfer, ...]
    compute: float
    """Seconds of compute per optimizer step (all micro steps)."""
    comm: float
    hidden: float
    ideal: float
    """Seconds the step's flops take at the cluster's peak rate (what `mfu` compares the step with)."""
    extra_memory: float
    """Bytes per rank beyond the stage's own (hpZ's secondary copy)."""

    @property
    def exposed(self) -> float:
        return self.comm - self.hidden

    @property
    def step(self) -> float:
        """Seconds per optimizer step: the compute and the communication it does not hide."""
        return self.compute + self.exposed

    @property
    def mfu(self) -> float:
        """Model flops utilisation of the whole step, exposed communication included."""
        return self.ideal / self.step

    def to_dict(self) -> dict[str, object]:
        return {
            "variant": self.variant.name,
            "transfers": [dataclasses.asdict(t) for t in self.transfers],
            **{k: getattr(self, k) for k in ("compute", "comm", "hidden", "exposed", "step", "mfu", "extra_memory")},
        }


def quantized_bytes(numel: float, bits: int) -> float:
    """Block-wise quantized size: `bits` per element and a 4-byte scale per block of QUANT_BLOCK elements."""
    return numel * bits / 8 + 4 * math.ceil(numel / QUANT_BLOCK)


def group_of(size: int, cluster: Cluster, what: str) -> tuple[int, int]:
    """(ranks per node, nodes) of a group of `size` consecutive ranks."""
    g = cluster.gpus_per_node
    if size <= g and g % size == 0:
        return size, 1
    if size > g and size % g == 0 and cluster.world % size == 0:
        return g, size // g
    raise ValueError(
        f"{what}={size} does not tile {cluster.nodes} nodes x {g} GPUs; use a divisor of {g} or a multiple of it "
        f"that divides {cluster.world}"
    )


def hierarchical(op: str, buffer: float, group: tuple[int, int]) -> tuple[float, float]:
    """(intra, inter) bytes one rank sends for `op` over `buffer` on `group` (an all-to-all sends the share of a
    reduce-scatter: all but its own chunk)."""
    a, b = group
    intra = (a - 1) / a * buffer
    inter = (b - 1) / b * buffer / a
    factor = 2 if op == "all_reduce" else 1
    return factor * intra, factor * inter


def _transfer(
    what: str,
    phase: str,
    op: str,
    buffer: float,
    group: tuple[int, int],
    cluster: Cluster,
    *,
    per_micro: bool = True,
) -> Transfer:
    intra, inter = hierarchical(op, buffer, group)
    seconds = intra / cluster.intra_bandwidth + inter / cluster.inter_per_gpu
    return Transfer(
        what=what, phase=phase, op=op, buffer=buffer, intra=intra, inter=inter, seconds=seconds, per_micro=per_micro
    )


def transfers(variant: Variant, *, numel: float, param_bytes: int, grad_bytes: int, cluster: Cluster) -> list[Transfer]:
    """The collectives of one optimizer step of `variant` for `numel` parameters."""
    world = (cluster.gpus_per_node, cluster.nodes)
    params, grads = numel * param_bytes, numel * grad_bytes
    if variant.stage < 3 and not variant.mics:
        if variant.stage == 0:
            return [_transfer("gradients", "backward", "all_reduce", grads, world, cluster, per_micro=False)]
        return [
            _transfer("gradients", "backward", "reduce_scatter", grads, world, cluster, per_micro=variant.stage == 2),
            _transfer("parameters", "step", "all_gather", params, world, cluster, per_micro=False),
        ]
    shard = group_of(variant.mics, cluster, "mics_shard_size") if variant.mics else world
    gathered = quantized_bytes(numel, 8) if variant.qwz else params
    backward = group_of(variant.hpz, cluster, "zero_hpz_partition_size") if variant.hpz > 1 else shard
    out = [
        _transfer("parameters", "forward", "all_gather", gathered, shard, cluster),
        _transfer("parameters", "backward", "all_gather", gathered, backward, cluster),
    ]
    if variant.qgz:
        out += quantized_gradient_exchanges(numel, shard, cluster)
    else:
        out.append(_transfer("gradients", "backward", "reduce_scatter", grads, shard, cluster))
    if variant.mics:
        size = shard[0] * shard[1]
        replicas = (cluster.gpus_per_node // shard[0], cluster.nodes // shard[1])
        out.append(
            _transfer("gradient shards", "backward", "all_reduce", grads / size, replicas, cluster, per_micro=False)
        )
    return out


def quantized_gradient_exchanges(numel: float, group: tuple[int, int], cluster: Cluster) -> list[Transfer]:
    """qgZ's two all-to-alls on a group of `a` ranks per node x `b` nodes: an int4 copy of the gradients inside
    the node (none when a is 1), an int8 copy of 1 / a of them across nodes (none when b is 1)."""
    a, b = group
    out = []
    if a > 1:
        inside = quantized_bytes(numel, 4)
        out.append(_transfer("gradients int4", "backward", "all_to_all", inside, (a, 1), cluster))
    if b > 1:
        across = quantized_bytes(numel / a, 8)
        out.append(_transfer("gradients int8", "backward", "all_to_all", across, (1, b), cluster))
    return out


def step_model(
    variant: Variant,
    *,
    numel: float,
    tokens_per_gpu: float,
    micro_steps: int,
    cluster: Cluster,
    param_bytes: int = 2,
    grad_bytes: int = 2,
) -> StepModel:
    """Time of one optimizer step of `micro_steps` micro steps of `tokens_per_gpu / micro_steps` tokens each."""
    moves = transfers(variant, numel=numel, param_bytes=param_bytes, grad_bytes=grad_bytes, cluster=cluster)
    compute = 6 * numel * tokens_per_gpu / (cluster.flops * cluster.mfu)
    share = {"forward": compute / micro_steps / 3, "backward": 2 * compute / micro_steps / 3}
    comm = hidden = 0.0
    for micro in range(micro_steps):
        last = micro == micro_steps - 1
        for phase, budget in share.items():
            spent = sum(t.seconds for t in moves if t.phase == phase and (t.per_micro or last))
            comm, hidden = comm + spent, hidden + min(spent, budget)
    comm += sum(t.seconds for t in moves if t.phase == "step")
    secondary = numel * param_bytes / variant.hpz if variant.hpz > 1 else 0.0
    return StepModel(
        variant=variant,
        transfers=tuple(moves),
        compute=compute,
        comm=comm,
        hidden=hidden,
        ideal=6 * numel * tokens_per_gpu / cluster.flops,
        extra_memory=secondary,
    )


def variant_from_config(zero: Mapping[str, object], *, name: str = "config") -> Variant:
    """The variant a config's `zero_optimization` section asks for (stage, the ZeRO++ keys, `mics_shard_size`)."""
    mics = int(zero.get("mics_shard_size", -1) or -1)  # type: ignore[call-overload]
    return Variant(
        name=name,
        stage=int(zero.get("stage", 0) or 0),  # type: ignore[call-overload]
        qwz=bool(zero.get("zero_quantized_weights", False)),
        qgz=bool(zero.get("zero_quantized_gradients", False)),
        hpz=max(1, int(zero.get("zero_hpz_partition_size", 1) or 1)),  # type: ignore[call-overload]
        mics=max(0, mics),
    )


def compare_variants(gpus_per_node: int) -> list[Variant]:
    """What `--compare` prints: the plain stages, each ZeRO++ feature alone and together, and MiCS in a node."""
    return [
        Variant(name="zero1", stage=1),
        Variant(name="zero2", stage=2),
        Variant(name="zero3", stage=3),
        Variant(name="zero3+qwZ", stage=3, qwz=True),
        Variant(name="zero3+hpZ", stage=3, hpz=gpus_per_node),
        Variant(name="zero3+qgZ", stage=3, qgz=True),
        Variant(name="zero++", stage=3, qwz=True, qgz=True, hpz=gpus_per_node),
        Variant(name=f"mics{gpus_per_node}", stage=3, mics=gpus_per_node),
    ]

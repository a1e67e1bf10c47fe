"""The cluster communication model (planner/comm_model.py, cluster.py) against bytes and times worked out by
hand: the hierarchical split of each collective, what each ZeRO, ZeRO++ and MiCS variant sends in each phase,
the compute time, the overlap, the units the command line parses, and the `--cluster` command itself."""

from __future__ import annotations

import math

import pytest

from slipstream.cli.main import main
from slipstream.planner.cluster import Cluster, parse_bandwidth, parse_flops
from slipstream.planner.comm_model import (
    Variant,
    hierarchical,
    quantized_bytes,
    step_model,
    transfers,
    variant_from_config,
)

N = 1e9  # parameters
CLUSTER = Cluster(nodes=2, gpus_per_node=4, intra_bandwidth=100e9, inter_bandwidth=40e9, flops=100e12, mfu=0.5)


def _by(variant: Variant, **kw: float) -> dict[tuple[str, str], tuple[float, float, float]]:
    moves = transfers(variant, numel=N, param_bytes=2, grad_bytes=2, cluster=CLUSTER, **kw)  # type: ignore[arg-type]
    return {(t.phase, t.op): (t.buffer, t.intra, t.inter) for t in moves}


def test_hierarchical_collectives_send_the_rings_share_split_by_tier() -> None:
    intra, inter = hierarchical("reduce_scatter", 1.0, (8, 16))
    assert (intra, inter) == (7 / 8, 15 / 16 / 8)
    assert intra + inter == pytest.approx(127 / 128)  # the flat ring's (n - 1) / n
    assert hierarchical("all_gather", 1.0, (8, 16)) == (intra, inter)
    assert hierarchical("all_reduce", 1.0, (8, 16)) == (2 * intra, 2 * inter)
    assert hierarchical("all_gather", 1.0, (1, 4)) == (0.0, 3 / 4)


def test_stage2_reduces_gradients_and_gathers_parameters_after_the_step() -> None:
    moves = _by(Variant(name="z2", stage=2))
    assert moves == {("backward", "reduce_scatter"): (2e9, 1.5e9, 2.5e8), ("step", "all_gather"): (2e9, 1.5e9, 2.5e8)}
    assert _by(Variant(name="z0", stage=0)) == {("backward", "all_reduce"): (2e9, 3e9, 5e8)}


def test_stage3_gathers_twice_and_reduce_scatters() -> None:
    moves = _by(Variant(name="z3", stage=3))
    assert moves == {
        ("forward", "all_gather"): (2e9, 1.5e9, 2.5e8),
        ("backward", "all_gather"): (2e9, 1.5e9, 2.5e8),
        ("backward", "reduce_scatter"): (2e9, 1.5e9, 2.5e8),
    }


def test_zero_plus_plus_quantizes_weights_and_gradients_and_keeps_the_backward_gather_in_the_node() -> None:
    scales = 4 * math.ceil(N / 256)
    assert quantized_bytes(N, 8) == N + scales and quantized_bytes(N, 4) == N / 2 + scales
    qwz = _by(Variant(name="q", stage=3, qwz=True))
    assert qwz[("forward", "all_gather")] == (N + scales, 0.75 * (N + scales), 0.5 * (N + scales) / 4)
    qgz = [t for t in transfers(Variant(name="g", stage=3, qgz=True), numel=N, param_bytes=2, grad_bytes=2,
                                cluster=CLUSTER) if t.phase == "backward" and t.what.startswith("gradients")]
    across = N / 4 + 4 * math.ceil(N / 4 / 256)  # each rank's quarter of its node's sum, int8
    assert [(t.op, t.buffer, t.intra, t.inter) for t in qgz] == [
        ("all_to_all", N / 2 + scales, 0.75 * (N / 2 + scales), 0.0),  # int4 inside the node
        ("all_to_all", across, 0.0, 0.5 * across),  # int8 across nodes
    ]
    hpz = step_model(Variant(name="h", stage=3, hpz=4), numel=N, tokens_per_gpu=1, micro_steps=1, cluster=CLUSTER)
    backward = [t for t in hpz.transfers if t.op == "all_gather" and t.phase == "backward"][0]
    assert (backward.intra, backward.inter) == (1.5e9, 0.0)
    assert hpz.extra_memory == 2 * N / 4  # the secondary copy, sharded over the node


def test_mics_shards_in_groups_and_all_reduces_across_replicas() -> None:
    moves = _by(Variant(name="m", stage=3, mics=4))
    assert moves[("forward", "all_gather")] == (2e9, 1.5e9, 0.0)
    assert moves[("backward", "reduce_scatter")] == (2e9, 1.5e9, 0.0)
    assert moves[("backward", "all_reduce")] == (2e9 / 4, 0.0, 2 * 0.5 * 2e9 / 4)
    with pytest.raises(ValueError, match="mics_shard_size=3 does not tile 2 nodes x 4 GPUs"):
        _by(Variant(name="m", stage=3, mics=3))


def test_step_time_is_compute_plus_the_communication_no_phase_can_hide() -> None:
    tokens = 1e5
    model = step_model(Variant(name="z2", stage=2), numel=N, tokens_per_gpu=tokens, micro_steps=1, cluster=CLUSTER)
    compute = 6 * N * tokens / (100e12 * 0.5)  # 12 s: 4 s forward, 8 s backward
    per_gather = 1.5e9 / 100e9 + 2.5e8 / (40e9 / 4)  # 0.015 + 0.025 s
    assert model.compute == pytest.approx(compute)
    assert model.comm == pytest.approx(2 * per_gather)
    assert model.hidden == pytest.approx(per_gather)  # the reduce-scatter hides in the backward, not the gather
    assert model.step == pytest.approx(compute + per_gather)
    assert model.mfu == pytest.approx(6 * N * tokens / (model.step * 100e12))
    slow = step_model(Variant(name="z3", stage=3), numel=N, tokens_per_gpu=10, micro_steps=1, cluster=CLUSTER)
    assert slow.hidden == pytest.approx(slow.compute) and slow.step == pytest.approx(slow.comm)


def test_gradient_accumulation_repeats_the_micro_step_collectives() -> None:
    one = step_model(Variant(name="z3", stage=3), numel=N, tokens_per_gpu=10, micro_steps=1, cluster=CLUSTER)
    four = step_model(Variant(name="z3", stage=3), numel=N, tokens_per_gpu=40, micro_steps=4, cluster=CLUSTER)
    assert four.comm == pytest.approx(4 * one.comm)
    z1 = [
        step_model(Variant(name="z1", stage=1), numel=N, tokens_per_gpu=10 * k, micro_steps=k, cluster=CLUSTER)
        for k in (1, 4)
    ]
    assert z1[1].comm == pytest.approx(z1[0].comm)  # stage 1 reduces once per step


def test_units_parse_and_bad_ones_say_how_to_write_them() -> None:
    assert parse_bandwidth("400Gb/s") == 50e9 and parse_bandwidth("400Gbps") == 50e9
    assert parse_bandwidth("900GB/s") == 900e9 and parse_bandwidth("5e10") == 5e10
    assert parse_flops("990e12") == 990e12 and parse_flops("990TFLOPS") == 990e12 and parse_flops("1P") == 1e15
    with pytest.raises(ValueError, match="--inter-bandwidth '9x' is not a bandwidth; write e.g. 900GB/s"):
        parse_bandwidth("9x", name="--inter-bandwidth")
    with pytest.raises(ValueError, match="must be above zero"):
        parse_flops("0")
    with pytest.raises(ValueError, match="Cluster.mfu must be in"):
        Cluster(nodes=1, gpus_per_node=1, intra_bandwidth=1, inter_bandwidth=1, flops=1, mfu=1.5)


def test_config_keys_choose_the_variant() -> None:
    zero = {
        "stage": 3,
        "zero_quantized_weights": True,
        "zero_quantized_gradients": True,
        "zero_hpz_partition_size": 8,
        "mics_shard_size": -1,
    }
    assert variant_from_config(zero) == Variant(name="config", stage=3, qwz=True, qgz=True, hpz=8, mics=0)
    assert variant_from_config({"stage": 3, "mics_shard_size": 4}).mics == 4


def test_the_cluster_command_prints_each_variant_and_rejects_missing_flags(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["plan", "--cluster", "--params", "7B", "--nodes", "8", "--gpus-per-node", "8", "--seq", "4096"]
    links = ["--intra-bandwidth", "900GB/s", "--inter-bandwidth", "400Gb/s", "--flops", "990e12"]
    assert main(base + links + ["--compare"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[2:]}
    assert list(rows) == ["zero1", "zero2", "zero3", "zero3+qwZ", "zero3+hpZ", "zero3+qgZ", "zero++", "mics8"]
    assert float(rows["zero++"][6]) < float(rows["zero3"][6])  # step seconds
    assert main(base + links) == 0
    assert "backward  reduce_scatter" in capsys.readouterr().out
    assert main(base + ["--flops", "990e12"]) == 2
    assert "give --intra-bandwidth, --inter-bandwidth" in capsys.readouterr().err
    assert main(base + links[:3] + ["40 furlongs", "--flops", "1"]) == 1
    assert "'40 furlongs' is not a bandwidth" in capsys.readouterr().err

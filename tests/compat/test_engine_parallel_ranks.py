"""The engine's rank and size getters under tensor and sequence parallelism (compat/engine_getters.py,
compat/engine_methods.py), against the layout's arithmetic (global rank = (data * sp + sequence) * tp + tensor,
slipstream/parallel/mesh.py) and the process groups themselves. One spawn of 4 ranks: TP=2 x DP=2 at ZeRO 3,
then SP=2 x DP=2 at ZeRO 1."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from slipstream.utils.torch_versions import torch_version
from tests.dist.parallel.models import TinyGPT
from tests.harness import run_distributed, run_subtests

# Tensor parallelism needs torch >= 2.5 (DTensor's public API; docs/support.md): on the oldest supported torch
# only the sequence-parallel layout is checked.
TP_CASE = {"tp": 2, "sp": 1, "stage": 3}
CASES = ([TP_CASE] if torch_version() >= (2, 5) else []) + [{"tp": 1, "sp": 2, "stage": 1}]


def _engine(tp: int, sp: int, stage: int) -> Any:
    import slipstream

    config = {
        "train_batch_size": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage},
        "tensor_parallel": {"autotp_size": tp},
        "sequence_parallel_size": sp,
    }
    group = slipstream.parallel.build_topology(tp=tp, sp=sp, device_type="cpu").sp_group if sp > 1 else None
    engine, *_ = slipstream.initialize(model=TinyGPT(sp_group=group), config=config)
    return engine


def _check_layout(tp: int, sp: int, stage: int) -> dict[str, Any]:
    from slipstream.utils import groups

    rank, world = dist.get_rank(), dist.get_world_size()
    engine = _engine(tp, sp, stage)
    try:
        tensor_index, sequence_index, data_index = rank % tp, (rank // tp) % sp, rank // (tp * sp)
        got = {
            "data_parallel_rank": engine.get_data_parallel_rank(),
            "data_parallel_world_size": engine.get_data_parallel_world_size(),
            "model_parallel_rank": engine.get_model_parallel_rank(),
            "tensor_parallel_rank": engine.get_tensor_parallel_rank(),
            "mp_world_size": engine.mp_world_size,
            "sequence_parallel_size": engine.sequence_parallel_size,
            "first_weights_partition_group": engine.is_first_weights_partition_group(),
        }
        want = {
            "data_parallel_rank": data_index,
            "data_parallel_world_size": world // (tp * sp),
            "model_parallel_rank": tensor_index,
            "tensor_parallel_rank": tensor_index,
            "mp_world_size": tp,
            "sequence_parallel_size": sp,
            "first_weights_partition_group": stage == 3,  # DeepSpeed 0.19: the weights are partitioned
        }
        assert got == want, f"rank {rank}, tp={tp} sp={sp}: {got} != {want}"
        topology = engine.parallel.topology
        if tp > 1:  # the groups agree with the arithmetic
            assert dist.get_rank(topology.tp_group) == tensor_index
            assert engine.mpu is groups and engine.mpu.get_model_parallel_rank() == tensor_index
            assert groups.get_data_parallel_rank() == data_index
        if sp > 1:
            assert dist.get_rank(engine.get_sequence_parallel_group()) == sequence_index
            assert engine.mpu.get_sequence_parallel_rank() == sequence_index
            assert groups.get_sequence_parallel_rank() == sequence_index
        assert groups.get_model_parallel_rank() == tensor_index
        return got
    finally:
        engine.destroy()


def _ranks(rank: int, world_size: int) -> list[Any]:
    return run_subtests(CASES, _check_layout)


def test_rank_getters_under_tp_and_sp() -> None:
    results = run_distributed(_ranks, world_size=4, timeout_s=240)
    by_case = [dict(zip(("tp" if c["tp"] > 1 else "sp" for c in CASES), r)) for r in results]
    assert [r["sp"]["data_parallel_rank"] for r in by_case] == [0, 0, 1, 1]  # SP=2: ranks 0,1 share one batch
    if TP_CASE in CASES:
        assert [r["tp"]["data_parallel_rank"] for r in by_case] == [0, 0, 1, 1]  # TP=2: ranks 0,1 hold one replica
        assert [r["tp"]["tensor_parallel_rank"] for r in by_case] == [0, 1, 0, 1]

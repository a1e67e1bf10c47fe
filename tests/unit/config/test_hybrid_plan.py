"""The `hybrid_engine` section into the engine plan: max_out_tokens, inference_tp_size, tp_gather_partition_size
and release_inference_cache honoured (plan fields), the combinations not built refused by name."""

from __future__ import annotations

import pytest

from slipstream.config.errors import ConfigError
from slipstream.config.resolve import resolve

BASE = {"train_micro_batch_size_per_gpu": 1}


def test_max_out_tokens_reaches_the_plan_and_unbuilt_keys_are_reported() -> None:
    plan = resolve({**BASE, "hybrid_engine": {"enabled": True, "max_out_tokens": 96}}, world_size=1)
    assert (plan.hybrid.generate, plan.hybrid.max_out_tokens) == (True, 96)
    assert not [key for key in plan.unimplemented if key.startswith("hybrid_engine")]
    assert resolve(BASE, world_size=1).hybrid.max_out_tokens == 512  # DeepSpeed's default
    hybrid = {"enabled": True, "inference_tp_size": 2, "release_inference_cache": True, "tp_gather_partition_size": 4}
    plan = resolve({**BASE, "hybrid_engine": hybrid}, world_size=4)
    assert not [key for key in plan.unimplemented if key.startswith("hybrid_engine")]
    assert (plan.hybrid.inference_tp_size, plan.hybrid.tp_gather_partition_size) == (2, 4)
    assert plan.hybrid.release_inference_cache
    default = resolve(BASE, world_size=1).hybrid  # DeepSpeed's defaults
    assert (default.inference_tp_size, default.tp_gather_partition_size, default.release_inference_cache) == (1, 8, False)


def test_cuda_graphs_and_tensor_parallel_generation_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"enable_cuda_graph.*not built.*cannot work"):
        resolve({**BASE, "hybrid_engine": {"enabled": True, "enable_cuda_graph": True}}, world_size=1)
    hybrid = {"enabled": True, "inference_tp_size": 2}
    with pytest.raises(ConfigError, match=r"inference_tp_size=2 does not divide the data-parallel world size 3"):
        resolve({**BASE, "hybrid_engine": hybrid}, world_size=3)
    with pytest.raises(ConfigError, match=r"inference_tp_size=2 with tensor_parallel.autotp_size=2.*not built"):
        resolve({**BASE, "hybrid_engine": hybrid, "tensor_parallel": {"autotp_size": 2}}, world_size=4)
    with pytest.raises(ConfigError, match=r"inference_tp_size=2 with .*sequence_parallel_size=2.*not built"):
        resolve({**BASE, "hybrid_engine": hybrid, "sequence_parallel_size": 2}, world_size=4)
    with pytest.raises(ConfigError, match=r"inference_tp_size=2 with hybrid_engine.pin_parameters=false.*not built"):
        resolve({**BASE, "hybrid_engine": {**hybrid, "pin_parameters": False}}, world_size=2)
    for key in ("inference_tp_size", "tp_gather_partition_size"):
        with pytest.raises(ConfigError, match=f"hybrid_engine.{key}"):
            resolve({**BASE, "hybrid_engine": {"enabled": True, key: 0}}, world_size=2)

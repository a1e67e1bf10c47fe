"""The `hybrid_engine` section into the engine plan: max_out_tokens honoured (the plan's bound), the keys not
built reported or refused by name."""

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
    hybrid = {"enabled": True, "release_inference_cache": True, "tp_gather_partition_size": 4}
    plan = resolve({**BASE, "hybrid_engine": hybrid}, world_size=1)
    assert {"hybrid_engine.release_inference_cache", "hybrid_engine.tp_gather_partition_size"} <= set(
        plan.unimplemented
    )


def test_cuda_graphs_and_tensor_parallel_generation_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"enable_cuda_graph.*not built.*cannot work"):
        resolve({**BASE, "hybrid_engine": {"enabled": True, "enable_cuda_graph": True}}, world_size=1)
    with pytest.raises(ConfigError, match=r"inference_tp_size=2.*not built"):
        resolve({**BASE, "hybrid_engine": {"enabled": True, "inference_tp_size": 2}}, world_size=1)

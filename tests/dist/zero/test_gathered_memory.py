"""ZeRO-3 gathers into memory the pool lends ([Note: lent gathered memory] in zero/stage3/pool.py).

From the second step on, every gather of a unit lands in memory the pool allocated before: the set of addresses
the units are gathered into is the same step after step, the pool holds no more bytes, and between steps the
units hold no memory (the pool does). Training is bit-identical to gathering with a plain `resize_` of the
storage (the path taken where torch cannot swap storages): same losses, same parameters. The engine's
`empty_partition_cache` frees the pool's gathered memory. Two ranks, one spawn.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from slipstream.utils.torch_shim import CAN_SWAP_STORAGE_MEMORY
from tests.harness import run_distributed
from tests.harness.models import TinyMLP


def _train(*, swap: bool) -> dict[str, Any]:
    """Five steps; the addresses each step's forward gathered into, the pool's bytes after each step."""
    import slipstream
    from slipstream.zero.stage3 import pool as pool_module

    original = pool_module.CAN_SWAP_STORAGE_MEMORY
    pool_module.CAN_SWAP_STORAGE_MEMORY = swap  # False: the fallback, the unit's storage grown at every gather
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    model = TinyMLP(48, 48, 48, num_layers=4)  # four units of one size: they share the pool's buffers
    engine, *_ = slipstream.initialize(model=model, config=config)
    units = [p.ds_record.unit for p in engine.module.layers.parameters()][::2]
    seen: list[int] = []
    for layer, unit in zip(engine.module.layers, units):  # after the engine's hook: the unit is gathered
        layer.register_forward_pre_hook(lambda m, a, unit=unit: seen.append(unit.full.data_ptr()))
    steps: list[dict[str, Any]] = []
    for seed in range(5):
        seen.clear()
        x = torch.randn(2, 48, generator=torch.Generator().manual_seed(seed))
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
        pool = engine.zero_model.pool
        held = sum(u.full.untyped_storage().nbytes() for u in units)
        steps.append({"loss": float(loss), "addresses": sorted(seen), "pool_bytes": pool.gathered_bytes, "held": held})
    params = {name: p.detach().clone() for name, p in engine.zero_model.full_state(only_rank0=False).items()}
    engine.empty_partition_cache()
    steps.append({"emptied_pool_bytes": engine.zero_model.pool.gathered_bytes})
    engine.destroy()
    pool_module.CAN_SWAP_STORAGE_MEMORY = original
    return {"steps": steps, "params": params, "unit_bytes": units[0].full_bytes}


def gathered_memory(rank: int, world: int) -> dict[str, Any]:
    return {"pooled": _train(swap=True), "resized": _train(swap=False)}


@pytest.mark.skipif(not CAN_SWAP_STORAGE_MEMORY, reason="this torch cannot swap storages' memory (the fallback runs)")
def test_gathers_reuse_the_pools_memory_and_train_alike(tmp_path: Path) -> None:
    for out in run_distributed(gathered_memory, world_size=2, tmp_dir=tmp_path, timeout_s=120):
        pooled, resized = out["pooled"], out["resized"]
        steps, emptied = pooled["steps"][:-1], pooled["steps"][-1]
        assert emptied["emptied_pool_bytes"] == 0, "empty_partition_cache frees the pool's gathered memory"
        for step in steps[1:]:
            assert step["addresses"] == steps[1]["addresses"], steps  # the same memory, step after step
            assert step["pool_bytes"] == steps[1]["pool_bytes"], steps
        assert steps[1]["pool_bytes"] == len(set(steps[1]["addresses"])) * pooled["unit_bytes"], steps
        assert all(step["held"] == 0 for step in steps), "between steps the units hold no gathered memory"
        assert [s["pool_bytes"] for s in resized["steps"][:-1]] == [0] * 5, resized["steps"]
        assert [s["loss"] for s in steps] == [s["loss"] for s in resized["steps"][:-1]]
        for name, value in pooled["params"].items():
            assert torch.equal(value, resized["params"][name]), name

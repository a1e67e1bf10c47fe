"""Tensors taken inside GatheredParameters at ZeRO-3 keep their values after the block.

`state_dict()` values, `p.detach()` and a view taken inside the block stay readable after it (before the fix
reading them killed the rank with SIGSEGV), keep the values of the gather while training goes on, and
their memory is freed when they die. The unit itself is released as before, and the training path keeps one
storage per unit and a fixed set of pool buffers (no per-step reallocation). World sizes 1 and 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.harness import run_distributed


class _Layers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(32, 32) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _storages(zero_model: Any) -> list[int]:
    return [unit.full.untyped_storage()._cdata for unit in zero_model.units]


def _step(engine: Any, seed: int) -> None:
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(seed))
    engine.backward(engine(x).pow(2).mean())
    engine.step()


def _gathered_and_dropped(engine: Any) -> None:
    """Inside the block: a state_dict, a detach and a view; outside: their values, then their memory."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from slipstream.zero import GatheredParameters, ZeroParamStatus

    weight = engine.module.layers[1].weight
    with GatheredParameters(list(engine.module.parameters())):
        state = engine.module.state_dict()
        detached = weight.detach()
        view = weight.view(-1)[40:70]  # a view of the parameter itself
        expected = {"state": {k: v.clone() for k, v in state.items()}, "detached": detached.clone(),
                    "view": view.detach().clone()}
        gathered = StorageWeakRef(detached.untyped_storage())
    unit = weight.ds_record.unit
    assert weight.ds_status is ZeroParamStatus.NOT_AVAILABLE and unit.full.untyped_storage().nbytes() == 0
    for _ in range(2):  # training goes on: new gathers, pool buffers reused, the values change
        for name, value in state.items():
            assert torch.equal(value, expected["state"][name]), name
        assert torch.equal(detached, expected["detached"])
        assert float(detached.sum()) == float(expected["detached"].sum())
        assert torch.equal(view.detach(), expected["view"])
        _step(engine, seed=7)
    with GatheredParameters([weight]):
        assert not torch.equal(weight, expected["detached"]), "the step changed the weight; the alias kept its values"
    assert not gathered.expired()
    del state, detached, view
    assert gathered.expired(), "the gathered storage is freed when its last alias dies"


def aliases(rank: int, world: int) -> dict[str, Any]:
    import slipstream
    from slipstream.zero import GatheredParameters

    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = slipstream.initialize(model=_Layers(), config=config)
    zero_model = engine.zero_model
    for seed in range(2):  # the first step records the order, the second prefetches along it
        _step(engine, seed)
    storages, pool_bytes = _storages(zero_model), zero_model.pool.allocated_bytes
    for seed in range(2, 5):
        _step(engine, seed)
    out = {"steps": (_storages(zero_model) == storages, pool_bytes, zero_model.pool.allocated_bytes)}
    with GatheredParameters(list(engine.module.parameters())):
        out["total"] = sum(float(p.sum()) for p in engine.module.parameters())  # nothing kept: no new storage
    out["no_alias"] = _storages(zero_model) == storages
    pool_bytes = zero_model.pool.allocated_bytes  # four units in flight at once: the pool holds more buffers
    _gathered_and_dropped(engine)
    after = _storages(zero_model)
    for seed in range(8, 11):
        _step(engine, seed)
    out["after"] = (_storages(zero_model) == after, pool_bytes, zero_model.pool.allocated_bytes)
    engine.destroy()
    return out


@pytest.mark.parametrize("world_size", [1, 2])
def test_tensors_taken_inside_gathered_parameters_stay_valid(tmp_path: Path, world_size: int) -> None:
    results = run_distributed(aliases, world_size=world_size, tmp_dir=tmp_path, timeout_s=120)
    for out in results:
        same, pool_before, pool_after = out["steps"]
        assert same and pool_after == pool_before and (pool_before > 0) == (world_size > 1), out
        assert out["no_alias"], "a GatheredParameters block that keeps nothing keeps each unit's storage"
        same, pool_before, pool_after = out["after"]
        assert same and pool_after == pool_before, out

"""safe_get_full_fp32_param / safe_get_full_grad on expert parameters (ep 2, two ranks): each rank holds other
experts under the same local names, so the whole value is assembled over the expert-data-parallel group, not the
world (summing two different experts)."""

from __future__ import annotations

import pytest
import torch

from tests.dist.moe.moe_models import TinyMoE, batches
from tests.dist.moe.test_moe import PER_RANK, config
from tests.harness import run_distributed


def access(rank: int, world: int, stage: int) -> dict:
    import slipstream
    from slipstream.utils import safe_get_full_fp32_param, safe_get_full_grad
    from slipstream.zero import GatheredParameters

    model = TinyMoE(ep_size=2, ep_rank=rank, k=1)
    engine, *_ = slipstream.initialize(model=model, config=config(stage))
    x, y = batches(1, world, PER_RANK)[0][rank]
    engine.backward(TinyMoE.loss(engine(x), y))
    named = list(engine.module.named_parameters())
    grads = {name: safe_get_full_grad(p) for name, p in named}
    engine.step()
    full = {name: safe_get_full_fp32_param(p) for name, p in named}
    with GatheredParameters([p for _, p in named]):
        local = {name: p.detach().clone() for name, p in named}
    engine.destroy()
    return {"grads": grads, "full": full, "local": local}


@pytest.mark.parametrize("stage", [2, 3])
def test_expert_params_are_assembled_over_their_group(stage: int, tmp_path) -> None:  # type: ignore[no-untyped-def]
    results = run_distributed(access, world_size=2, tmp_dir=tmp_path, stage=stage)
    for rank, out in enumerate(results):
        experts = [name for name in out["full"] if ".experts." in name]
        assert experts, sorted(out["full"])
        for name, value in out["full"].items():
            torch.testing.assert_close(value, out["local"][name].float(), rtol=0, atol=0, msg=f"rank {rank} {name}")
            assert out["grads"][name].shape == value.shape, name
    for name in results[0]["full"]:
        if ".experts." in name:  # different experts (global 0-1 on rank 0, 2-3 on rank 1), different values
            assert not torch.equal(results[0]["full"][name], results[1]["full"][name]), name
        else:  # shared parameters and their gradients agree
            assert torch.equal(results[0]["full"][name], results[1]["full"][name]), name
            torch.testing.assert_close(results[0]["grads"][name], results[1]["grads"][name], rtol=0, atol=0)

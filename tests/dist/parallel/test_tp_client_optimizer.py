"""AutoTP with the optimizer the client built before `initialize` (`torch.optim.Adam(model.parameters(),
fused=True)`, as a training script or Transformers' Trainer does): TP replaces the split layers' parameters
with their local shards, so the optimizer's groups must follow them. TP=2 at ZeRO 0, no clipping, 5 steps:
the losses and the global parameters equal one process's (the same fused Adam), for the client's optimizer and
for the config's alike; one spawn of 2 ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.dist.parallel.models import TinyGPT, batches, loss_fn
from tests.dist.parallel.test_tp_sp_training import BATCH, EPS, LR, STEPS, train_step
from tests.harness import run_distributed, run_subtests

CASES = [{"client": True, "stage": 0}, {"client": False, "stage": 0}, {"client": True, "stage": 1}]


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=LR, eps=EPS, fused=True)


def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = TinyGPT()
    opt = _adam(model.parameters())
    losses = []
    for x, y in batches(STEPS, BATCH):
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def train(rank: int, world: int, *, client: bool, stage: int) -> dict[str, Any]:
    import slipstream

    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0,
        "steps_per_print": 1000,
        "zero_optimization": {"stage": stage},
        "tensor_parallel": {"autotp_size": 2},
    }
    model = TinyGPT()
    optimizer = _adam(model.parameters()) if client else None  # before initialize: the unsplit parameters
    if not client:
        config["optimizer"] = {
            "type": "Adam",
            "params": {"lr": LR, "eps": EPS, "weight_decay": 0.0, "torch_adam": True},
        }
    engine, *_ = slipstream.initialize(model=model, optimizer=optimizer, config=config)
    losses = [train_step(engine, x, y) for x, y in batches(STEPS, BATCH)]
    params = engine._zero3_consolidated_16bit_state_dict()
    engine.destroy()
    return {"losses": losses, "params": params if rank == 0 else None}


def grid(rank: int, world: int) -> list[dict[str, Any]]:
    return run_subtests(CASES, lambda **case: train(rank, world, **case))


def test_tp2_with_a_client_optimizer_built_before_initialize_matches_single_process() -> None:
    ref_losses, ref_params = reference()
    for case, got in zip(CASES, run_distributed(grid, world_size=2, timeout_s=180)[0]):
        assert got["losses"] == pytest.approx(ref_losses, rel=1e-5), (case, got["losses"], ref_losses)
        assert set(got["params"]) >= set(ref_params), case
        for name, value in ref_params.items():
            error = float((got["params"][name] - value).norm() / value.norm())
            assert error <= 1e-5, (case, name, error)

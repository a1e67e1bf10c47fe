"""DeepSpeed's gradient accessors (`safe_get_full_grad`, `safe_set_full_grad`, the local variants,
`safe_update_full_grad_vectorized`) at ZeRO stages 0-3 on two ranks, against a single-process reference.

Each rank trains its own micro-batches (2 per step, so the accessors are called at the accumulation
boundary); the reference averages the per-micro-batch gradients of all four micro-batches in one process.
The setters are checked through the step they feed: with SGD (no momentum) the parameter moves by exactly
lr x the gradient that was set.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed
from tests.harness.models import TinyMLP

LR = 0.1
GAS = 2


def _batches(rank: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro-batches of one step (the global batch is every rank's, in rank order)."""
    model = TinyMLP()
    return [model.make_batch(seed=100 * rank + micro, batch_size=3) for micro in range(GAS)]


def _reference_grads(world: int) -> list[torch.Tensor]:
    """The averaged gradient of one step in one process: mean over every rank's micro-batches."""
    model = TinyMLP()
    sums = [torch.zeros_like(p) for p in model.parameters()]
    for rank in range(world):
        for x, y in _batches(rank, world):
            model.zero_grad()
            TinyMLP.loss(model(x), y).backward()
            for total, p in zip(sums, model.parameters()):
                total += p.grad
    return [s / (world * GAS) for s in sums]


def _engine(stage: int):  # type: ignore[no-untyped-def]
    import slipstream

    model = TinyMLP()
    config = {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 0.0,  # the set values are large: the step must use them unclipped
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 64},  # several buckets, params cut across
    }
    engine, *_ = slipstream.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), config=config)
    return engine


def _full_params(engine) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    from slipstream.utils import safe_get_full_fp32_param

    return [safe_get_full_fp32_param(p).clone() for p in engine.module.parameters()]


def _backward_window(engine, rank: int, world: int, *, mid_window_read: list | None = None) -> None:  # type: ignore[no-untyped-def]
    from slipstream.utils import safe_get_full_grad

    for micro, (x, y) in enumerate(_batches(rank, world)):
        engine.backward(TinyMLP.loss(engine(x), y))
        if micro < GAS - 1:
            if mid_window_read is not None:
                try:
                    safe_get_full_grad(next(engine.module.parameters()))
                except RuntimeError as exc:
                    mid_window_read.append(str(exc))
            engine.step()


def _moved_by_step(stage: int, rank: int, world: int, edit, *, mid_window_read: list | None = None) -> list:  # type: ignore[no-untyped-def]
    """Train one step's micro-batches, run `edit(params)` between the last backward and step(), step, and
    return how far the step moved each parameter, divided by the SGD learning rate (= the gradient it used)."""
    engine = _engine(stage)
    params = list(engine.module.parameters())
    before = _full_params(engine)
    _backward_window(engine, rank, world, mid_window_read=mid_window_read)
    edit(params)
    engine.step()
    moved = [(b - a) / LR for b, a in zip(before, _full_params(engine))]
    engine.destroy()
    return moved


def grad_access(rank: int, world: int, stage: int) -> dict:
    from slipstream.utils import (
        safe_get_full_grad,
        safe_get_local_grad,
        safe_set_full_grad,
        safe_set_local_grad,
        safe_update_full_grad_vectorized,
    )

    out: dict = {"mid_window_error": []}

    def read(params: list) -> None:  # the averaged gradient, twice (the second read must not reduce again)
        out["full"] = [safe_get_full_grad(p).clone() for p in params]
        out["full_again"] = [safe_get_full_grad(p).clone() for p in params]
        out["local_numel"] = [safe_get_local_grad(p).numel() for p in params]

    def set_full(params: list) -> None:  # the step must use exactly these values
        for i, p in enumerate(params):
            safe_set_full_grad(p, torch.full(tuple(p.ds_shape if hasattr(p, "ds_shape") else p.shape), 0.01 * (i + 1)))
        out["read_after_set"] = [safe_get_full_grad(p).clone() for p in params]

    def update(params: list) -> None:  # each rank triples its part, then the vectorized update halves: net x1.5
        for p in params:
            safe_set_local_grad(p, 3.0 * safe_get_local_grad(p))
        safe_update_full_grad_vectorized(params, lambda grad, param: grad * 0.5)

    out["moved_by_read"] = _moved_by_step(stage, rank, world, read, mid_window_read=out["mid_window_error"])
    out["moved_by_set"] = _moved_by_step(stage, rank, world, set_full)
    out["moved_by_update"] = _moved_by_step(stage, rank, world, update)
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gradient_accessors_match_the_single_process_gradient(stage: int, tmp_path) -> None:  # type: ignore[no-untyped-def]
    world = 2
    results = run_distributed(grad_access, world_size=world, tmp_dir=tmp_path, stage=stage)
    reference = _reference_grads(world)
    numels = [r.numel() for r in reference]
    for rank, out in enumerate(results):
        assert len(out["mid_window_error"]) == 1 and "micro-batch 1 of 2" in out["mid_window_error"][0], out
        for i, ref in enumerate(reference):
            torch.testing.assert_close(out["full"][i], ref, rtol=1e-5, atol=1e-7, msg=f"rank {rank} param {i}")
            assert torch.equal(out["full_again"][i], out["full"][i]), (rank, i)
            torch.testing.assert_close(out["moved_by_read"][i], ref, rtol=1e-4, atol=1e-6)
            value = torch.full_like(ref, 0.01 * (i + 1))
            torch.testing.assert_close(out["read_after_set"][i], value, rtol=1e-6, atol=1e-8)
            torch.testing.assert_close(out["moved_by_set"][i], value, rtol=1e-4, atol=1e-6)
            torch.testing.assert_close(out["moved_by_update"][i], 1.5 * ref, rtol=1e-4, atol=1e-6)
    local = [sum(out["local_numel"][i] for out in results) for i in range(len(numels))]
    # stage 0: every rank steps the whole parameter; above it, the ranks' parts add up to it once
    assert local == ([world * n for n in numels] if stage == 0 else numels), (local, numels)

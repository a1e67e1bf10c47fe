"""1-bit Adam at ZeRO stage 1 on gloo, 2 ranks, in one spawn, against a single-process reference written here.

- The reference: TinyMLP and both ranks' rows in one process. During warm-up each step is 1-bit Adam's Adam on the
  mean gradient; after it each parameter's gradients (one bucket per parameter: reduce_bucket_size 1) go through
  the 1-bit all-reduce's definition (`reference_all_reduce`, test_onebit.py) and the momentum takes the result,
  the variance frozen. The engine's parameters equal it after every step, and a compressed step sends no
  reduce-scatter, only the 1-bit all-to-all and all-gather.
- fp16: a step whose gradient is not finite on one rank is skipped on both, the error buffers stay finite.
- A param group's exp_avg_mask keeps the masked elements of every rank's momentum shard at zero.
- Checkpoints: saved in the compressed phase (ZeRO 0 and 1), a 2-rank resume is exact (the bucket errors come
  back); a 1-rank load restarts the errors from zero with a logged line and trains on.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch

from tests.dist.optim.test_onebit import LR, batches, reference_all_reduce
from tests.harness import run_distributed
from tests.harness.models import TinyMLP

FREEZE = 3
STEPS = 8
BETAS, EPS, DECAY = (0.9, 0.999), 1e-8, 0.01


def engine_for(
    stage: int, *, freeze_step: int = FREEZE, precision: dict | None = None, mask: torch.Tensor | None = None
) -> object:
    """TinyMLP with 1-bit Adam at `stage`, one bucket per parameter (most of them padded at 2 ranks); `mask`: one
    param group's exp_avg_mask over all its parameters."""
    import slipstream

    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {
            "type": "OneBitAdam",
            "params": {"lr": LR, "weight_decay": DECAY, "freeze_step": freeze_step, "comm_backend_name": "gloo"},
        },
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 1},  # one bucket per parameter
        "gradient_clipping": 0.0,
        **(precision or {}),
    }
    model = TinyMLP()
    groups = None if mask is None else [{"params": list(model.parameters()), "exp_avg_mask": mask}]
    return slipstream.initialize(model=model, model_parameters=groups, config=config)[0]


def rows(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    inputs, targets = batches()[step]
    return inputs[4 * rank : 4 * rank + 4], targets[4 * rank : 4 * rank + 4]


def reference_steps(world: int, steps: int) -> list[list[torch.Tensor]]:
    """The parameters after each step: warm-up Adam on the mean gradient, then the compressed gradient."""
    model = TinyMLP()
    params = list(model.parameters())
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    padded = [p.numel() + (-p.numel()) % world for p in params]  # the bucket's padding to the world size
    errors = [([torch.zeros(math.ceil(n / (8 * world)) * 8 * world) for _ in range(world)],) for n in padded]
    errors = [(e[0], [torch.zeros(e[0][0].numel() // world) for _ in range(world)]) for e in errors]
    out = []
    for step in range(steps):
        grads = []
        for rank in range(world):
            model.zero_grad()
            TinyMLP.loss(model(rows(step, rank)[0]), rows(step, rank)[1]).backward()
            grads.append([p.grad.clone() for p in params])
        with torch.no_grad():
            for i, p in enumerate(params):
                if step < FREEZE:
                    g = sum(grads[r][i] for r in range(world)) / world
                else:
                    local = [torch.cat([grads[r][i].reshape(-1) / world, torch.zeros(padded[i] - p.numel())])
                             for r in range(world)]  # fmt: skip
                    g = (reference_all_reduce(local, *errors[i])[: p.numel()] * world).view_as(p)
                m[i].mul_(BETAS[0]).add_(g, alpha=1 - BETAS[0])  # the in-place forms round as the engine's do
                if step < FREEZE:
                    v[i].mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1])
                p.sub_(torch.div(m[i], v[i].sqrt().add_(EPS)).add_(p, alpha=DECAY), alpha=LR)
        out.append([p.detach().clone() for p in params])
    return out


def check_against_reference(rank: int, world: int) -> None:
    from slipstream.comm import count_collectives

    expected = reference_steps(world, STEPS)
    engine = engine_for(1)
    for step in range(STEPS):
        x, y = rows(step, rank)
        with count_collectives() as counted:
            engine.backward(TinyMLP.loss(engine(x), y))
            engine.step()
        for mine, ref in zip(engine.module.parameters(), expected[step]):
            torch.testing.assert_close(mine.detach(), ref, rtol=0, atol=0, msg=f"step {step + 1}")
        sent = dict(counted.bytes)
        if step < FREEZE:
            assert sent.get("reduce_scatter", 0) > 0 and "all_to_all" not in sent, (step, sent)
        else:
            assert "reduce_scatter" not in sent, (step, sent)
            grad_bytes = sum(p.numel() * 4 for p in engine.module.parameters())
            assert 0 < sent["all_to_all"] < grad_bytes / 16, (step, sent)
    assert engine.basic_optimizer.compresses_gradients()
    engine.destroy()


def check_fp16_overflow_on_one_rank(rank: int, world: int) -> None:
    """Rank 0's gradient is infinite at step 5 (compressed): both ranks skip it and no error buffer is poisoned."""
    import torch.distributed as dist

    engine = engine_for(1, freeze_step=2, precision={"fp16": {"enabled": True, "initial_scale_power": 8}})
    before = None
    for step in range(7):
        x, y = rows(step, rank)
        loss = TinyMLP.loss(engine(x), y)
        if step == 4:
            before = torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()])
            loss = loss * (float("inf") if rank == 0 else 1.0)
        engine.backward(loss)
        engine.step()
        if step == 4:
            after = torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()])
            assert torch.equal(before, after), "the overflowing step moved the parameters"
    errors = engine.basic_optimizer.error_buffers()
    assert errors and all(bool(torch.isfinite(e).all()) for e in errors.values())
    final = torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()])
    gathered = [torch.empty_like(final) for _ in range(world)]
    dist.all_gather(gathered, final)
    assert torch.equal(gathered[0], gathered[1]) and bool(torch.isfinite(final).all())
    engine.destroy()


def train(engine: object, first: int, count: int, rank: int) -> torch.Tensor:
    for step in range(first, first + count):
        x, y = rows(step, rank)
        engine.backward(TinyMLP.loss(engine(x), y))
        engine.step()
    return torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()])


def check_resume(rank: int, world: int, *, directory: str) -> dict[int, torch.Tensor]:
    """Saved after 5 steps (2 compressed); a 2-rank resume repeats the next 2 steps exactly, errors included."""
    saved = {}
    for stage in (0, 1):
        first = engine_for(stage, freeze_step=3)
        saved[stage] = train(first, 0, 5, rank)
        first.save_checkpoint(directory, tag=f"stage{stage}")
        assert any(e.abs().sum() > 0 for e in first.basic_optimizer.error_buffers().values())
        expected = train(first, 5, 2, rank)
        first.destroy()
        second = engine_for(stage, freeze_step=3)
        second.load_checkpoint(directory, tag=f"stage{stage}")
        assert torch.equal(train(second, 5, 2, rank), expected), f"stage {stage}"
        second.destroy()
    return saved


def load_on_one_rank(rank: int, world: int, *, directory: str) -> dict[int, tuple[torch.Tensor, list[str], float]]:
    from slipstream.utils.logging import get_logger

    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    get_logger().addHandler(handler)
    out = {}
    try:
        for stage in (0, 1):
            logged.clear()
            engine = engine_for(stage, freeze_step=3)
            engine.load_checkpoint(directory, tag=f"stage{stage}")
            loaded = torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()])
            state = engine.basic_optimizer.first_state()
            assert state is not None and int(state["step"]) == 5, state
            train(engine, 5, 2, 0)
            out[stage] = (loaded, [m for m in logged if "start again from zero" in m], engine.last_loss)
            engine.destroy()
    finally:
        get_logger().removeHandler(handler)
    return out


def check_mask_on_shards(rank: int, world: int) -> None:
    """Each rank's shard of the momentum is zero where the group's mask is, after compressed steps."""
    mask = torch.ones(sum(p.numel() for p in TinyMLP().parameters()))
    mask[::3] = 0.0
    engine = engine_for(1, freeze_step=2, mask=mask)
    train(engine, 0, 4, rank)
    optimizer = engine.basic_optimizer
    whole = optimizer.whole_tensors()
    starts = [sum(math.prod(shape) for shape in whole.shapes[:k]) for k in range(len(whole.shapes))]
    checked = 0
    for piece in optimizer.param_groups[0]["params"]:
        momentum = optimizer.state[piece]["exp_avg"].view(-1)
        for part in whole.parts(piece):
            wanted = mask[starts[part.tensor] + part.lo : starts[part.tensor] + part.lo + part.numel]
            values = momentum[part.offset : part.offset + part.numel]
            assert values[wanted == 0].eq(0).all() and values[wanted != 0].ne(0).any(), (rank, part)
            checked += part.numel
    assert 0 < checked < mask.numel()  # a shard
    engine.destroy()


def run_all(rank: int, world: int, directory: str) -> dict[int, torch.Tensor]:
    check_mask_on_shards(rank, world)
    check_against_reference(rank, world)
    check_fp16_overflow_on_one_rank(rank, world)
    return check_resume(rank, world, directory=directory)


def test_onebit_adam_at_zero_stage_1(tmp_path: Path) -> None:
    saved = run_distributed(run_all, world_size=2, timeout_s=240, directory=str(tmp_path))[0]
    loaded = run_distributed(load_on_one_rank, world_size=1, timeout_s=120, directory=str(tmp_path))[0]
    for stage in (0, 1):
        params, notices, loss = loaded[stage]
        assert torch.equal(params, saved[stage]), f"stage {stage}: the 1-rank load has other parameters"
        assert len(notices) == 1 and "world size 2" in notices[0], (stage, notices)
        assert math.isfinite(loss), (stage, loss)

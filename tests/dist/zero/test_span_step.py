"""The span-by-span step of stages 1 and 2 ([Note: overlapped gather of the updated pieces] in zero/span_step.py):
each span's gather launched as soon as its update is done gives bit for bit the parameters, optimizer state and
losses of the step taken whole and then gathered, one all-gather per span. Rank 1 reaches every step late, so a
gather not waited for (or launched before its update) shows on rank 0. One spawn runs every case."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from tests.harness import run_distributed, run_subtests
from tests.harness.models import TinyMLP

STEPS = 3
BATCH = 8
SPAN_BYTES = 2048  # spans of a few 200-element buckets: several spans per step
CASES = [{"stage": 1}, {"stage": 2}, {"stage": 2, "bf16": True}]
"""bf16: the masters are fp32 copies, cast into the bf16 parameters span by span."""


def train(rank: int, world: int, *, stage: int, overlapped: bool, bf16: bool = False) -> dict:
    from slipstream.comm import count_collectives
    from slipstream.config import resolve
    from slipstream.zero.comm_stream import CommStream
    from slipstream.zero.span_step import SpanStep
    from slipstream.zero.stage1 import Stage1Optimizer
    from slipstream.zero.stage2 import Stage2Optimizer

    model = TinyMLP().to(torch.bfloat16 if bf16 else torch.float32)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    config = {"train_batch_size": BATCH, "zero_optimization": {"stage": stage, "reduce_bucket_size": 200}}
    plan = resolve({**config, "bf16": {"enabled": bf16}}, world_size=world)
    zero = {1: Stage1Optimizer, 2: Stage2Optimizer}[stage](inner, zero=plan.zero, precision=plan.precision)
    assert isinstance(zero.span_step, SpanStep)  # AdamW on the device: the span schedule applies by default
    zero.span_step = SpanStep(zero.groups, comm=CommStream(enabled=True), span_bytes=SPAN_BYTES) if overlapped else None
    per_rank, losses, gathers = BATCH // world, [], []
    for seed in range(STEPS):
        inputs, targets = model.make_batch(seed=seed, batch_size=BATCH)
        x, y = inputs[rank * per_rank : (rank + 1) * per_rank], targets[rank * per_rank : (rank + 1) * per_rank]
        loss = model.loss(model(x.to(next(model.parameters()).dtype)).float(), y)
        losses.append(loss.detach().clone())
        loss.backward()
        zero.micro_step_done(reduce=True)
        if rank == 1:
            time.sleep(0.2)  # rank 0's gathers wait for rank 1's pieces
        with count_collectives() as counter:
            zero.step(grad_divisor=world, clip=1.0)
        params = {n: p.detach().clone() for n, p in model.named_parameters()}  # at once, before any other collective
        gathers.append(counter.calls["all_gather"])
    state = [t.clone() for s in zero.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    dist.barrier()
    spans = sum(len(s) for s in zero.span_step.spans) if zero.span_step is not None else 1
    return {"losses": losses, "params": params, "state": state, "gathers": gathers, "spans": spans}


def grid(rank: int, world: int) -> list[dict]:
    return run_subtests(
        [{**case, "overlapped": on} for case in CASES for on in (True, False)],
        lambda **case: train(rank, world, **case),
    )


def test_span_step_equals_whole_step_bit_for_bit(tmp_path) -> None:  # type: ignore[no-untyped-def]
    per_rank = run_distributed(grid, world_size=2, tmp_dir=tmp_path)
    for rank, results in enumerate(per_rank):
        for case, (spanned, whole) in zip(CASES, zip(results[::2], results[1::2])):
            where = f"{case} rank {rank}"
            assert spanned["spans"] > 1, where
            assert spanned["gathers"] == [spanned["spans"]] * STEPS and whole["gathers"] == [1] * STEPS, where
            assert all(torch.equal(a, b) for a, b in zip(spanned["losses"], whole["losses"])), where
            for name, value in whole["params"].items():
                assert torch.equal(spanned["params"][name], value), f"{where}: {name} differs"
            assert len(spanned["state"]) == len(whole["state"]), where
            assert all(torch.equal(a, b) for a, b in zip(spanned["state"], whole["state"])), f"{where}: state"

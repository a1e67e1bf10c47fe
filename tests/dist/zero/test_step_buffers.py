"""The buffers of ZeRO stages 0-2's reductions and parameter gather, on two ranks (one spawn runs every case).

- gather: after the step every rank's flat params hold every rank's pieces bit for bit, -0.0, inf and NaN
  included ([Note: gathering the pieces] in zero/flat_group.py: on the host an all-reduce over -0.0).
- in place: at stage 1 the step's reduce-scatter sums the full-size gradient storage itself (no copy of a
  bucket), so after `settle_gradients()` the whole storage holds the sum over the ranks.
- bounded staging: at stages 0 and 1 with gradients travelling in bf16 and one bucket for the whole model
  (DeepSpeed's default `reduce_bucket_size`), the staging ring stays within the staging bound (here 1 KiB of
  fp32 gradients: chunks of 128 elements per rank), its bytes are what the planner counts, and the reduced
  gradients equal those of a ring sized for the whole bucket.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.harness import run_distributed, run_subtests
from tests.harness.models import TinyMLP

BATCH = 4
STAGING_BYTES = 1024
SPECIAL = (-0.0, float("inf"), float("nan"), -1e-40)
"""Written into each rank's own piece: a sum over +0.0 would turn -0.0 into +0.0."""


def _optimizer(stage: int, world: int, *, bucket: int = 600, dtype: str | None = None, staging_bytes: int = 0):  # type: ignore[no-untyped-def]
    from slipstream.config import resolve
    from slipstream.zero import layout
    from slipstream.zero.stage0 import Stage0Optimizer
    from slipstream.zero.stage1 import Stage1Optimizer
    from slipstream.zero.stage2 import Stage2Optimizer

    cls = {0: Stage0Optimizer, 1: Stage1Optimizer, 2: Stage2Optimizer}[stage]
    model = TinyMLP()
    config: dict = {"train_batch_size": BATCH, "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket}}
    if dtype is not None:
        config["communication_data_type"] = dtype
    plan = resolve(config, world_size=world)
    bound = layout.STAGE2_STAGING_BYTES
    layout.STAGE2_STAGING_BYTES = staging_bytes or bound
    try:
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return model, cls(inner, zero=plan.zero, precision=plan.precision)
    finally:
        layout.STAGE2_STAGING_BYTES = bound


def _backward(model: TinyMLP, rank: int) -> None:
    x, y = model.make_batch(seed=rank, batch_size=BATCH // 2)
    model.loss(model(x), y).backward()


def gather_case(rank: int, world: int, *, stage: int) -> None:
    model, zero = _optimizer(stage, world)
    flat = zero.groups[0]
    marked = []
    with torch.no_grad():
        for piece, (start, _end) in zip(flat.master_pieces, flat.piece_ranges):
            piece[: len(SPECIAL)] = torch.tensor(SPECIAL)
            marked.append(start)
    zero.publish_loaded()
    starts = [None] * world
    dist.all_gather_object(starts, marked)
    for owner_starts in starts:
        for start in owner_starts:
            got = flat.flat_params[start : start + len(SPECIAL)]
            want = torch.tensor(SPECIAL)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (stage, rank, got)


def in_place_case(rank: int, world: int) -> None:
    model, zero = _optimizer(1, world)
    _backward(model, rank)
    zero.micro_step_done(reduce=True)
    expected = zero.groups[0].grad_storage.clone()
    dist.all_reduce(expected)
    zero.settle_gradients()
    assert torch.equal(zero.groups[0].grad_storage, expected), "the stage-1 storage was not summed in place"


def bounded_case(rank: int, world: int, *, stage: int) -> None:
    from slipstream.planner.reduce_buffers import step_reducer_bytes
    from slipstream.zero import layout

    grads = []
    for staging_bytes in (STAGING_BYTES, 2**30):
        model, zero = _optimizer(stage, world, bucket=500_000_000, dtype="bf16", staging_bytes=staging_bytes)
        _backward(model, rank)
        zero.settle_gradients()
        grads.append(torch.cat(zero.groups[0].owned_grads).clone())
        if staging_bytes != STAGING_BYTES:
            continue
        flat = zero.groups[0]
        assert len(flat.layout.buckets) == 1 and flat.layout.buckets[0].piece_numel > 128
        chunk = STAGING_BYTES // 4 // world
        assert zero.owned_bytes()["comm_buffers"] == 2 * (world + 1) * chunk * 2, zero.owned_bytes()
        bound = layout.STAGE2_STAGING_BYTES
        layout.STAGE2_STAGING_BYTES = STAGING_BYTES
        try:
            planned = step_reducer_bytes(flat.layout, reduce_dtype="bf16", storage_dtype="fp32")
        finally:
            layout.STAGE2_STAGING_BYTES = bound
        assert planned == zero.owned_bytes()["comm_buffers"], (planned, zero.owned_bytes())
    assert torch.equal(grads[0], grads[1]), f"stage {stage}: chunked reduction differs from the whole-bucket one"


CASES = [
    {"kind": "gather", "stage": 1},
    {"kind": "gather", "stage": 2},
    {"kind": "in_place"},
    {"kind": "bounded", "stage": 0},
    {"kind": "bounded", "stage": 1},
]


def grid(rank: int, world: int) -> list[None]:
    functions = {"gather": gather_case, "in_place": in_place_case, "bounded": bounded_case}
    return run_subtests(CASES, lambda kind, **case: functions[kind](rank, world, **case))


def test_step_buffers(tmp_path) -> None:  # type: ignore[no-untyped-def]
    run_distributed(grid, world_size=2, tmp_dir=tmp_path)

"""Gradient reduction on two ranks: `overlap_comm` on and off (stages 1-3) and `communication_data_type`
(stages 0-3), through the engine. One spawn runs every case.

- overlap_comm: the same training with the reductions waited for at launch and left in flight gives
  bit-identical parameters, and with it on the staging ring really held several reductions at once
  (`peak_in_flight`), so an overlap that silently ran synchronously fails.
- communication_data_type: the averaged gradient the step will use equals a single-process reference that
  casts each rank's gradient to that dtype, sums the two in it and averages in fp32 (exactly for fp32, within
  the dtype's rounding of one sum for bf16 and fp16), and the sum is a value of that dtype (it travelled in it).
"""

from __future__ import annotations

import torch

from tests.harness import run_distributed, run_subtests
from tests.harness.models import TinyMLP

MICRO = 3
STEPS = 3
OVERLAP_CASES = [{"stage": s, "overlap": o} for s in (1, 2, 3) for o in (False, True)]
# bf16 at every stage; fp32 and fp16 each at one stage of each reduction path (stages 0-1: StepReducer, 2-3: ring)
DTYPE_CASES = [{"stage": s, "dtype": "bf16"} for s in (0, 1, 2, 3)] + [
    {"stage": 0, "dtype": "fp32"},
    {"stage": 2, "dtype": "fp32"},
    {"stage": 1, "dtype": "fp16"},
    {"stage": 3, "dtype": "fp16"},
]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return TinyMLP().make_batch(seed=10 * step + rank, batch_size=MICRO)


def _engine(stage: int, **extra: object):  # type: ignore[no-untyped-def]
    import slipstream

    model = TinyMLP()
    zero = {"stage": stage, "reduce_bucket_size": 64, "stage3_param_persistence_threshold": 0}
    zero.update(extra.pop("zero", {}))  # type: ignore[arg-type]
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.0, "zero_optimization": zero, **extra}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = slipstream.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def overlap_case(rank: int, world: int, *, stage: int, overlap: bool) -> dict:
    from slipstream.utils import safe_get_full_fp32_param

    engine = _engine(stage, zero={"overlap_comm": overlap})
    calls = _count_ring_calls(engine) if stage > 1 else {}
    for step in range(STEPS):
        x, y = _batch(rank, step)
        engine.backward(TinyMLP.loss(engine(x), y))
        engine.step()
    params = [safe_get_full_fp32_param(p).clone() for p in engine.module.parameters()]
    # stage 1: reductions launched during backward and in flight at the step; stages 2-3: in the staging ring
    peak = engine.optimizer.peak_in_flight if stage == 1 else engine.optimizer._ring.peak_in_flight
    refused = ""
    if stage == 1 and overlap:  # a second backward before the step: its buckets are already being reduced
        x, y = _batch(rank, 0)
        engine.backward(TinyMLP.loss(engine(x), y))
        try:
            engine.backward(TinyMLP.loss(engine(x), y))
        except RuntimeError as exc:
            refused = str(exc)
        engine.optimizer.zero_grad()  # waits for the reductions in flight (every rank launched the same)
    engine.destroy()
    return {"params": params, "peak_in_flight": peak, "refused": refused, "calls": calls}


def _count_ring_calls(engine) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """Counts of the staging ring's `launching` (the communication stream's context) and `launched` calls: every
    reduction of stages 2 and 3 must be launched inside the former (zero/comm_stream.py)."""
    ring, calls = engine.optimizer._ring, {"launching": 0, "launched": 0}
    for name in calls:
        method = getattr(ring, name)

        def counted(*args, _method=method, _name=name, **kwargs):  # type: ignore[no-untyped-def]
            calls[_name] += 1
            return _method(*args, **kwargs)

        setattr(ring, name, counted)
    return calls


def dtype_case(rank: int, world: int, *, stage: int, dtype: str) -> dict:
    from slipstream.utils import safe_get_full_grad

    engine = _engine(stage, communication_data_type=dtype)
    x, y = _batch(rank, 0)
    engine.backward(TinyMLP.loss(engine(x), y))
    grads = [safe_get_full_grad(p).clone() for p in engine.module.parameters()]
    engine.step()
    engine.destroy()
    return {"grads": grads}


def grid(rank: int, world: int) -> dict:
    return {
        "overlap": run_subtests(OVERLAP_CASES, lambda **case: overlap_case(rank, world, **case)),
        "dtype": run_subtests(DTYPE_CASES, lambda **case: dtype_case(rank, world, **case)),
    }


def _reference_grads(world: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(average, error bound) per parameter: each rank's gradient cast to `dtype` and summed in `dtype`, averaged
    in fp32; the bound is the dtype's rounding of one sum, eps x the sum of the magnitudes (over the world)."""
    per_rank = []
    for rank in range(world):
        model = TinyMLP()
        x, y = _batch(rank, 0)
        TinyMLP.loss(model(x), y).backward()
        per_rank.append([p.grad.to(dtype) for p in model.parameters()])
    eps = 0.0 if dtype == torch.float32 else torch.finfo(dtype).eps
    return [
        (sum(grads[1:], grads[0]).float() / world, eps * sum(g.float().abs() for g in grads) / world)
        for grads in zip(*per_rank)
    ]


def test_overlap_comm_and_communication_data_type(tmp_path) -> None:  # type: ignore[no-untyped-def]
    per_rank = run_distributed(grid, world_size=2, tmp_dir=tmp_path, timeout_s=240)
    for rank, result in enumerate(per_rank):
        by_case = dict(zip(map(str, OVERLAP_CASES), result["overlap"]))
        for stage in (1, 2, 3):
            off, on = by_case[str({"stage": stage, "overlap": False})], by_case[str({"stage": stage, "overlap": True})]
            for a, b in zip(off["params"], on["params"]):
                assert torch.equal(a, b), f"stage {stage} rank {rank}: overlap_comm changed the parameters"
            assert off["peak_in_flight"] == 0, f"stage {stage}: overlap_comm false left reductions in flight"
            assert on["peak_in_flight"] >= 2, f"stage {stage}: overlap_comm true never had two reductions in flight"
            if stage > 1:  # every reduction launched under the ring's communication-stream context
                calls = on["calls"]
                assert calls["launched"] > 0 and calls["launching"] == calls["launched"], f"stage {stage}: {calls}"
        refused = by_case[str({"stage": 1, "overlap": True})]["refused"]
        assert "second gradient for 'layers.2" in refused and "overlap_comm to false" in refused, refused
        for case, out in zip(DTYPE_CASES, result["dtype"]):
            dtype = DTYPES[case["dtype"]]
            for index, (got, (want, bound)) in enumerate(zip(out["grads"], _reference_grads(2, dtype))):
                where = f"{case} rank {rank} parameter {index}"
                assert bool(((got - want).abs() <= bound).all()), f"{where}: off the reference by more than the bound"
                summed = got * 2  # the sum that travelled (exact: a power of two), a value of `dtype`
                assert torch.equal(summed.to(dtype).float(), summed), f"{where}: the sum was not computed in {dtype}"

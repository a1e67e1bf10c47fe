"""Tensor and sequence parallel training of a tiny Llama-style GPT against a single-process run: after 5 steps
the global parameters equal the reference to 2e-5 relative (fp32) and the logged losses match, with gradient
clipping on (so the global norm over TP shards must be right). One spawn of 2 ranks (TP=2 at ZeRO 0-3, SP=2 at
ZeRO 0 and 3) and one of 4 (TP=2 x DP=2 at ZeRO 2 and 3, SP=2 x DP=2 at ZeRO 1)."""

from __future__ import annotations

import torch

from tests.dist.parallel.models import TinyGPT, batches, loss_fn
from tests.harness import run_distributed, run_subtests

STEPS, BATCH, LR, CLIP = 5, 4, 1e-2, 0.5
CASES_2 = [{"tp": 2, "sp": 1, "stage": s} for s in (0, 1, 2, 3)] + [{"tp": 1, "sp": 2, "stage": s} for s in (0, 3)]
CASES_4 = [{"tp": 2, "sp": 1, "stage": 2}, {"tp": 2, "sp": 1, "stage": 3}, {"tp": 1, "sp": 2, "stage": 1}]


def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for x, y in batches(STEPS, BATCH):
        loss = loss_fn(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def train(rank: int, world: int, *, tp: int, sp: int, stage: int) -> dict:
    import slipstream
    from slipstream.sequence.data import shard_sequence

    config = {"train_batch_size": BATCH, "gradient_clipping": CLIP, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": LR}}, "zero_optimization": {"stage": stage},
              "tensor_parallel": {"autotp_size": tp}, "sequence_parallel_size": sp}
    probe = slipstream.parallel.build_topology(tp=tp, sp=sp, device_type="cpu") if sp > 1 else None
    model = TinyGPT(sp_group=probe.sp_group if probe else None)
    engine, *_ = slipstream.initialize(model=model, config=config)
    topo = engine.parallel.topology
    per = BATCH // topo.dp
    losses = []
    for x, y in batches(STEPS, BATCH):
        rows = slice(topo.data_index * per, (topo.data_index + 1) * per)
        batch = {"input_ids": x[rows], "labels": y[rows]}
        if sp > 1:
            batch = shard_sequence(batch, topo.sp_group)  # adds the slice's position_ids
        loss = loss_fn(engine(batch["input_ids"], batch.get("position_ids")), batch["labels"])
        engine.backward(loss)
        engine.step()
        losses.append(engine.last_loss)
    params = engine._zero3_consolidated_16bit_state_dict()
    engine.destroy()
    return {"losses": losses, "params": params if rank == 0 else None}


def _check(results: list[dict], cases: list[dict]) -> None:
    ref_losses, ref_params = reference()
    for case, got in zip(cases, results):
        assert got["losses"] == pytest_approx(ref_losses), (case, got["losses"], ref_losses)
        for name, value in ref_params.items():
            torch.testing.assert_close(got["params"][name], value, rtol=2e-5, atol=2e-5 * float(value.abs().max()),
                                       msg=lambda m, n=name, c=case: f"{c} {n}: {m}")


def pytest_approx(values: list[float]):  # type: ignore[no-untyped-def]
    import pytest

    return pytest.approx(values, rel=1e-5)


def grid2(rank: int, world: int) -> list[dict]:
    return run_subtests(CASES_2, lambda **case: train(rank, world, **case))


def grid4(rank: int, world: int) -> list[dict]:
    return run_subtests(CASES_4, lambda **case: train(rank, world, **case))


def test_tp2_and_sp2_match_single_process() -> None:
    _check(run_distributed(grid2, world_size=2)[0], CASES_2)


def test_tp2_dp2_and_sp2_dp2_match_single_process() -> None:
    _check(run_distributed(grid4, world_size=4, timeout_s=240)[0], CASES_4)

"""LAMB and Muon through the engine at ZeRO stages 0-3 and with CPU offload, on 2 ranks: after 5 steps the
parameters equal a single-process reference written out below as a plain per-tensor loop. reduce_bucket_size
300 gives several buckets, so each rank steps several pieces that hold parts of several parameters, and the
37 x 37 weight (a bucket of its own) is cut across the two ranks; at stage 3 every parameter is. A trust ratio
from a rank's part of a parameter, or Newton-Schulz on a part of a matrix, lands far from the reference.
A LAMB run (stage 2) and a Muon run (stage 3) save at 2 ranks after 3 steps; the test loads each at 1 rank and
the last 2 steps match as well.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

import slipstream
from tests.harness import run_distributed, run_subtests
from tests.harness.models import TinyMLP

STEPS = 5
SAVED_AT = 3
BATCH = 8
LAMB = {"type": "Lamb", "params": {"lr": 2e-2, "weight_decay": 0.01, "max_coeff": 10.0, "min_coeff": 0.01}}
MUON = {"type": "Muon", "params": {"muon_lr": 2e-2, "adam_lr": 1e-2, "weight_decay": 0.01}}
PLACES = [(0, None), (1, None), (2, None), (3, None), (2, "cpu"), (3, "cpu")]
SAVES = {("lamb", 2, None), ("muon", 3, None)}
"""The runs that save at step SAVED_AT (tag: the kind); the test loads each at 1 rank, at ZeRO 1 and 0."""
CASES = [{"kind": kind, "stage": stage, "offload": offload} for kind in ("lamb", "muon") for stage, offload in PLACES]


def config(kind: str, stage: int, offload: str | None, *, world: int) -> dict:
    zero: dict = {"stage": stage, "reduce_bucket_size": 300, "stage3_param_persistence_threshold": 0,
                  "sub_group_size": 600}
    if offload:
        zero["offload_optimizer"] = {"device": offload}
    return {"train_batch_size": BATCH, "train_micro_batch_size_per_gpu": BATCH // world, "gradient_clipping": 0.0,
            "optimizer": LAMB if kind == "lamb" else MUON, "zero_optimization": zero}


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [TinyMLP().make_batch(seed=40 + s, batch_size=BATCH) for s in range(STEPS)]


def train(engine: object, rank: int, world: int, steps: range) -> None:
    per_rank = BATCH // world
    for inputs, targets in [batches()[s] for s in steps]:
        x, y = inputs[rank * per_rank:(rank + 1) * per_rank], targets[rank * per_rank:(rank + 1) * per_rank]
        engine.backward(TinyMLP.loss(engine(x), y))  # type: ignore[attr-defined]
        engine.step()  # type: ignore[attr-defined]


def run_case(rank: int, world: int, *, kind: str, stage: int, offload: str | None, save_dir: str) -> dict:
    engine, *_ = slipstream.initialize(model=TinyMLP(), config=config(kind, stage, offload, world=world))
    assert type(engine.basic_optimizer).__name__ == ("FusedLamb" if kind == "lamb" else "MuonWithAuxAdam")
    if (kind, stage, offload) in SAVES:
        train(engine, rank, world, range(SAVED_AT))
        engine.save_checkpoint(save_dir, tag=kind)
        train(engine, rank, world, range(SAVED_AT, STEPS))
    else:
        train(engine, rank, world, range(STEPS))
    from slipstream.zero import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):  # whole at stage 3
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return params


def grid(rank: int, world: int, save_dir: str) -> list[dict]:
    return run_subtests(CASES, lambda **case: run_case(rank, world, save_dir=save_dir, **case))


# ---- the reference: a plain loop over whole tensors -------------------------------------------------------------
def lamb_step(p: torch.Tensor, g: torch.Tensor, state: dict, *, lr: float, wd: float) -> None:
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    state["step"] = state.get("step", 0) + 1
    m = state["m"] = beta1 * state.get("m", torch.zeros_like(p)) + (1 - beta1) * g
    v = state["v"] = beta2 * state.get("v", torch.zeros_like(p)) + (1 - beta2) * g * g
    u = m / (v.sqrt() + eps) + wd * p  # DeepSpeed's kernel: the bias correction is in the step size
    w_norm, u_norm = float(p.norm()), float(u.norm())
    ratio = min(max(w_norm / u_norm, 0.01), 10.0) if w_norm and u_norm else 1.0
    step_size = lr * math.sqrt(1 - beta2 ** state["step"]) / (1 - beta1 ** state["step"])
    p.sub_(step_size * ratio * u)


def orthogonalise(u: torch.Tensor) -> torch.Tensor:
    x = u.T if u.shape[0] > u.shape[1] else u
    x = x / (x.norm() + 1e-7)
    for _ in range(5):
        a = x @ x.T
        x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
    x = x.T if u.shape[0] > u.shape[1] else x
    return x * math.sqrt(max(1.0, u.shape[0] / u.shape[1]))


def muon_step(p: torch.Tensor, g: torch.Tensor, state: dict, *, lr: float, wd: float) -> None:
    m = state["m"] = 0.95 * state.get("m", torch.zeros_like(p)) + 0.05 * g
    p.mul_(1 - lr * wd).sub_(lr * orthogonalise(0.05 * g + 0.95 * m))


def adamw_step(p: torch.Tensor, g: torch.Tensor, state: dict, *, lr: float, wd: float) -> None:
    beta1, beta2, eps = 0.9, 0.95, 1e-10
    state["step"] = state.get("step", 0) + 1
    m = state["m"] = beta1 * state.get("m", torch.zeros_like(p)) + (1 - beta1) * g
    v = state["v"] = beta2 * state.get("v", torch.zeros_like(p)) + (1 - beta2) * g * g
    update = (m / (1 - beta1 ** state["step"])) / ((v / (1 - beta2 ** state["step"])).sqrt() + eps)
    p.mul_(1 - lr * wd).sub_(lr * update)


def reference(kind: str) -> dict[str, torch.Tensor]:
    model = TinyMLP()
    states: dict[str, dict] = {}
    for inputs, targets in batches():
        model.zero_grad()
        TinyMLP.loss(model(inputs), targets).backward()
        with torch.no_grad():
            for name, p in model.named_parameters():
                assert p.grad is not None
                state = states.setdefault(name, {})
                if kind == "lamb":
                    lamb_step(p, p.grad, state, lr=2e-2, wd=0.01)
                elif p.dim() >= 2:
                    muon_step(p, p.grad, state, lr=2e-2, wd=0.01)
                else:
                    adamw_step(p, p.grad, state, lr=1e-2, wd=0.01)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_lamb_and_muon_match_a_per_tensor_reference_at_every_stage(tmp_path: Path) -> None:
    per_rank = run_distributed(grid, world_size=2, tmp_dir=tmp_path, save_dir=str(tmp_path / "ckpt"))
    expected = {kind: reference(kind) for kind in ("lamb", "muon")}
    initial = dict(TinyMLP().named_parameters())
    for case, *results in zip(CASES, *per_rank):
        for rank, params in enumerate(results):
            for name, value in params.items():
                torch.testing.assert_close(value, expected[case["kind"]][name], rtol=0, atol=2e-5,
                                           msg=lambda m, c=case, r=rank, n=name: f"{c} rank {r} {n}: {m}")
                assert float((value - initial[name]).abs().max()) > 1e-3  # it trained
    # the checkpoints saved at 2 ranks (LAMB at stage 2, Muon at stage 3) loaded at 1 rank (stages 1 and 0): the
    # optimizer state resharded, the remaining steps match too
    for kind, stage in (("lamb", 1), ("muon", 0)):
        engine, *_ = slipstream.initialize(model=TinyMLP(), config=config(kind, stage, None, world=1))
        engine.load_checkpoint(str(tmp_path / "ckpt"), tag=kind)
        train(engine, 0, 1, range(SAVED_AT, STEPS))
        for name, value in engine.module.named_parameters():
            torch.testing.assert_close(value.detach(), expected[kind][name], rtol=0, atol=2e-5,
                                       msg=lambda m, k=kind, n=name: f"{k} resumed at 1 rank, {n}: {m}")
        engine.destroy()

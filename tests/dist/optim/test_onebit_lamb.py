"""OneBitLamb on gloo, 2 ranks, in one spawn.

- Optimizer level: every step equals 1-bit LAMB written out here per tensor (the warm-up's LAMB step and its
  running-average coefficient; then the compressed momentum, the reconstructed gradient's fresh variance and the
  frozen coefficient times the clamped factor), in cases where the factor's [factor_min, factor_max] clamp and its
  factor_threshold limit each bind. The state dict (error buffers included) resumes a compressed step exactly.
- Through the engine at ZeRO 0: after warm-up the loss follows LAMB's within a bound, the ranks' parameters stay
  equal, and a compressed step hands the collectives exactly the 1-bit bytes (no gradient all-reduce); a
  checkpoint taken in the compressed phase resumes exactly.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import torch

from tests.dist.optim.test_onebit import (
    LR,
    STEPS,
    WARMUP_STEPS,
    check_engine_checkpoint,
    onebit,
    reference_all_reduce,
    train,
)
from tests.harness import run_distributed
from tests.harness.models import TinyMLP

SHAPES = ((7, 5), (13,))
FREEZE = 4
RUN = 9


def gradient(step: int, rank: int, index: int) -> torch.Tensor:
    return torch.randn(SHAPES[index], generator=torch.Generator().manual_seed(1000 * step + 10 * rank + index))


def initial(index: int) -> torch.Tensor:
    return torch.randn(SHAPES[index], generator=torch.Generator().manual_seed(7 + index))


def limited(factor: float, last: float, args: dict) -> float:
    factor = min(max(factor, args["factor_min"]), args["factor_max"])
    return min(max(factor, last * (1 - args["factor_threshold"])), last * (1 + args["factor_threshold"]))


def reference_run(world: int, args: dict) -> list[tuple[list[torch.Tensor], list[float]]]:
    """1-bit LAMB per tensor, every rank's gradient known here: (parameters, coefficients) after each step. The
    compressed momenta of all tensors travel in one buffer, each scaled by its frozen scaling coefficient."""
    lr, wd, eps, (beta1, beta2) = args["lr"], args["weight_decay"], 1e-8, (0.9, 0.999)
    tensors = [{"w": initial(i), "frozen": 0.0, "last": 1.0} for i in range(len(SHAPES))]
    for t in tensors:
        t["m"], t["v"] = torch.zeros_like(t["w"]), torch.zeros_like(t["w"])
    total = sum(t["w"].numel() for t in tensors)
    padded = math.ceil(total / (8 * world)) * 8 * world
    errors = ([torch.zeros(padded) for _ in range(world)], [torch.zeros(padded // world) for _ in range(world)])
    history = []
    for step in range(1, RUN + 1):
        grads = [[gradient(step, rank, i) for rank in range(world)] for i in range(len(SHAPES))]
        if step > FREEZE:
            if "fresh" not in tensors[0]:
                scales = [float(t["m"].norm()) / math.sqrt(t["m"].numel()) for t in tensors]
                for t, scale in zip(tensors, scales):
                    t["fresh"], t["scaling"] = t["v"].clone(), sum(scales) / len(scales) / scale
            local = [
                torch.cat(
                    [
                        ((beta1 * t["m"] + (1 - beta1) * g[rank]) * t["scaling"]).reshape(-1)
                        for t, g in zip(tensors, grads)
                    ]
                )
                for rank in range(world)
            ]
            means = reference_all_reduce(local, *errors).split([t["w"].numel() for t in tensors])
        coeffs = []
        for i, t in enumerate(tensors):
            if step <= FREEZE:
                g = torch.stack(grads[i]).mean(dim=0)
                t["m"] = beta1 * t["m"] + (1 - beta1) * g
                t["v"] = beta2 * t["v"] + (1 - beta2) * g * g
                u = t["m"] / (t["v"].sqrt() + eps) + wd * t["w"]
                w_norm, u_norm = float(t["w"].norm()), float(u.norm())
                c = min(max(w_norm / u_norm, 0.01), 10.0) if w_norm and u_norm else 1.0
                if c != 1.0:
                    t["frozen"] = args["coeff_beta"] * t["frozen"] + (1 - args["coeff_beta"]) * c
            else:
                m = means[i].view_as(t["w"]) / t["scaling"]
                g = (m - beta1 * t["m"]) / (1 - beta1)
                t["fresh"] = beta2 * t["fresh"] + (1 - beta2) * g * g
                t["m"] = m
                denom = t["v"].sqrt() + eps
                u = m / denom + wd * t["w"]
                factor = float((denom / (t["fresh"].sqrt() + eps)).max())
                if wd > 0:
                    share = min(1.0, float((m / denom).norm()) / float(u.norm()))
                    factor = factor * share + 1 - share
                t["last"] = limited(factor, t["last"], args)
                c = t["frozen"] * t["last"]
            t["w"] = t["w"] - lr * c * u
            coeffs.append(c)
        history.append(([t["w"].clone() for t in tensors], coeffs))
    return history


def build(args: dict) -> tuple[torch.optim.Optimizer, torch.nn.Parameter]:
    """OneBitLamb stepping one flat piece that holds both tensors, as ZeRO 0 hands it, with its whole-tensor map."""
    from slipstream.optim.onebit import OneBitLamb
    from slipstream.zero.whole_tensors import TensorPart, WholeTensorMap

    piece = torch.nn.Parameter(torch.cat([initial(i).reshape(-1) for i in range(len(SHAPES))]))
    optimizer = OneBitLamb([piece], freeze_step=FREEZE, comm_backend_name="gloo", **args)
    sizes = [math.prod(shape) for shape in SHAPES]
    parts = tuple(TensorPart(tensor=i, offset=sum(sizes[:i]), numel=n, lo=0) for i, n in enumerate(sizes))
    whole = WholeTensorMap(shapes=SHAPES, group_of=(0, 0), parts_of={id(piece): parts}, split=frozenset())
    optimizer.attach_whole_tensors(whole)
    optimizer.takes_over_reduction(None)
    return optimizer, piece


def take_step(optimizer: torch.optim.Optimizer, piece: torch.nn.Parameter, step: int, rank: int, world: int) -> None:
    """The warm-up gets the mean gradient (what the engine's all-reduce gives it); a compressed step this rank's."""
    grads = [torch.cat([gradient(step, r, i).reshape(-1) for i in range(len(SHAPES))]) for r in range(world)]
    piece.grad = torch.stack(grads).mean(dim=0) if step <= FREEZE else grads[rank]
    optimizer.step()


def check_against_reference(rank: int, world: int) -> None:
    cases = {
        "threshold binds": {
            "lr": 0.05,
            "weight_decay": 0.01,
            "coeff_beta": 0.9,
            "factor_max": 4.0,
            "factor_min": 0.5,
            "factor_threshold": 0.01,
        },
        "clamp binds": {
            "lr": 0.05,
            "weight_decay": 0.0,
            "coeff_beta": 0.5,
            "factor_max": 1.02,
            "factor_min": 0.98,
            "factor_threshold": 0.5,
        },
    }
    for name, args in cases.items():
        expected = reference_run(world, args)
        optimizer, piece = build(args)
        for step, (want_params, want_coeffs) in enumerate(expected, start=1):
            take_step(optimizer, piece, step, rank, world)
            assert optimizer.next_step_is_local() == (step >= FREEZE), (name, step)
            want = torch.cat([w.reshape(-1) for w in want_params])
            torch.testing.assert_close(piece.detach(), want, rtol=1e-5, atol=1e-6, msg=f"{name}, step {step}")
            got = optimizer.get_lamb_coeffs()
            close = len(got) == len(want_coeffs) and all(
                math.isclose(a, b, rel_tol=1e-5) for a, b in zip(got, want_coeffs)
            )
            assert close, (name, step, got, want_coeffs)
        check_resume(optimizer, piece, args, rank=rank, world=world)


def check_resume(
    optimizer: torch.optim.Optimizer, piece: torch.nn.Parameter, args: dict, *, rank: int, world: int
) -> None:
    """A copy built from the state dict (moments, frozen coefficients, factors, errors) steps as the original."""
    saved = copy.deepcopy(optimizer.state_dict())
    names = ("lamb_coeff_freeze", "last_factor", "scaling_coeff", "server", "worker")
    assert sorted(saved["onebit_errors"]["buffers"]) == [f"0.0.{name}" for name in names]
    loaded, copied = build(args)
    with torch.no_grad():
        copied.copy_(piece)
    loaded.load_state_dict(saved)
    take_step(optimizer, piece, RUN + 1, rank, world)
    take_step(loaded, copied, RUN + 1, rank, world)
    assert torch.equal(copied, piece)


def check_engine(rank: int, world: int) -> None:
    """Compressed steps through the engine: LAMB's loss within a bound, equal ranks, 1-bit bytes only."""
    import torch.distributed as dist

    from slipstream.comm.compressed import padded_numel

    lamb = train(rank, world, {"type": "Lamb", "params": {"lr": LR, "weight_decay": 0.01}}, steps=STEPS)
    mine = train(rank, world, onebit("OneBitLamb", freeze_step=WARMUP_STEPS), steps=STEPS)
    first, last, lamb_last = mine["losses"][0], sum(mine["losses"][-6:]) / 6, sum(lamb["losses"][-6:]) / 6
    assert last < 0.75 * first and last < 1.25 * lamb_last, f"losses {mine['losses']} vs LAMB's {lamb['losses']}"
    gathered = [torch.empty_like(mine["params"]) for _ in range(world)]
    dist.all_gather(gathered, mine["params"])
    assert torch.equal(gathered[0], gathered[1])
    numel = sum(p.numel() for p in TinyMLP().parameters())  # ZeRO 0 hands the optimizer one flat piece
    rows = world * (padded_numel(numel, world) // world // 8 + 4)
    assert mine["last_step"].get("all_reduce", 0) < 64, mine["last_step"]  # the loss only
    assert mine["last_step"].get("all_to_all") == rows and mine["last_step"].get("all_gather") == rows, mine


def run_all(rank: int, world: int, directory: str) -> None:
    check_against_reference(rank, world)
    check_engine(rank, world)
    # an engine checkpoint in the compressed phase (moments, frozen ratios and factors, errors) resumes exactly
    check_engine_checkpoint(rank, world, directory=directory, runs={"OneBitLamb": onebit("OneBitLamb", freeze_step=2)})


def test_onebit_lamb(tmp_path: Path) -> None:
    run_distributed(run_all, world_size=2, timeout_s=180, directory=str(tmp_path))

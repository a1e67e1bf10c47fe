"""Block-Hessian eigenvalues: power iteration on quadratic blocks whose Hessian is known in closed form
(0.5 x^T A x has Hessian A), the config rules, and the engine writing DeepSpeed's monitor events at the
configured steps without changing the training itself."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from torch import nn

import slipstream
from slipstream.config import ConfigError, resolve
from slipstream.profiling.eigenvalue import block_eigenvalues, find_blocks, relative_to_largest


def _symmetric(eigenvalues: list[float], seed: int) -> torch.Tensor:
    """Q diag(eigenvalues) Q^T for a random orthogonal Q."""
    generator = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(len(eigenvalues), len(eigenvalues), generator=generator, dtype=torch.float64))
    return (q * torch.tensor(eigenvalues, dtype=torch.float64)) @ q.T


class Quadratic(nn.Module):
    """loss = 0.5 x^T A x + b . x: Hessian A whatever x and b are."""

    def __init__(self, eigenvalues: list[float], seed: int) -> None:
        super().__init__()
        self.register_buffer("a", _symmetric(eigenvalues, seed).float())
        self.x = nn.Parameter(torch.randn(len(eigenvalues)))
        self.b = nn.Parameter(torch.randn(len(eigenvalues)))  # linear: no second-order term, left out

    def forward(self) -> torch.Tensor:
        return 0.5 * self.x @ self.a @ self.x + self.b @ self.x.detach()


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList([Quadratic([4.0, -1.5, 1.0, 0.5], 0), Quadratic([0.5, -2.0, 1.0], 1)])

    def forward(self, scale: torch.Tensor) -> torch.Tensor:
        return sum((block() for block in self.encoder.layers), scale.sum() * 0)


def test_the_eigenvalue_of_a_known_hessian() -> None:
    model = Blocks()
    loss = model(torch.ones(1))
    blocks = find_blocks(model, "encoder.layers", 2)
    tight = block_eigenvalues(loss, blocks, max_iter=200, tol=1e-8, stability=0.0)
    assert [b.value for b in tight] == pytest.approx([4.0, -2.0], rel=1e-5)  # the largest in magnitude, signed
    loose = block_eigenvalues(loss, blocks, max_iter=100, tol=1e-2, stability=1e-6)
    assert [b.value for b in loose] == pytest.approx([4.0, -2.0], rel=1e-2)
    assert all(b.iterations < t.iterations for b, t in zip(loose, tight))
    capped = block_eigenvalues(loss, blocks, max_iter=1, tol=1e-8, stability=0.0)
    assert [b.iterations for b in capped] == [1, 1]
    loss.backward()  # the graph is still there for the training backward
    assert relative_to_largest([4.0, -2.0, 0.0]) == [1.0, 0.5, 1.0]
    with pytest.raises(ValueError, match="has no attribute 'blocks'"):
        find_blocks(model, "encoder.blocks", 1)
    with pytest.raises(ValueError, match="holds 2 blocks"):
        find_blocks(model, "encoder.layers", 3)


BASE = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
}
EIGEN = {"enabled": True, "layer_name": "encoder.layers", "layer_num": 2, "gas_boundary_resolution": 2, "tol": 1e-6}


def test_config_rules() -> None:
    plan = resolve({**BASE, "eigenvalue": EIGEN}, world_size=1)
    assert plan.eigenvalue is not None and plan.eigenvalue.every_steps == 2 and not plan.unimplemented
    with pytest.raises(ConfigError, match="eigenvalue is enabled but layer_num is 0"):
        resolve({**BASE, "eigenvalue": {"enabled": True}}, world_size=1)
    moq = resolve({**BASE, "eigenvalue": EIGEN, "quantize_training": {"enabled": True}}, world_size=1)
    assert "eigenvalue.quantize_training" in moq.unimplemented
    stage3 = resolve({**BASE, "eigenvalue": EIGEN, "zero_optimization": {"stage": 3}}, world_size=1)
    assert stage3.eigenvalue is None and "eigenvalue" in stage3.unimplemented


def _train(config: dict[str, object], steps: int) -> tuple[slipstream.DeepSpeedEngine, list[torch.Tensor]]:
    torch.manual_seed(0)
    engine, *_ = slipstream.initialize(model=Blocks(), config={**BASE, **config})
    for _ in range(steps * 2):
        engine.backward(engine(torch.ones(1)))
        engine.step()
    next_draw = torch.randn(4)  # the same with or without the probe: it draws from a generator of its own
    return engine, [p.detach().clone() for p in engine.module.parameters()] + [next_draw]


def test_the_engine_writes_the_eigenvalues_at_the_configured_steps(tmp_path: Path) -> None:
    monitor = {"csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "run"}}
    engine, params = _train({"eigenvalue": EIGEN, **monitor}, steps=5)
    rows = {}
    for block in (0, 1):
        with open(tmp_path / "run" / f"Train_Eigenvalues_ModelBlockParam_{block}.csv") as handle:
            rows[block] = [(int(r["step"]), float(r["value"])) for r in csv.DictReader(handle)]
    # steps 2 and 4 of 5 (gas_boundary_resolution 2); 2 samples per step: at samples 4 and 8; |-2| / 4 = 0.5
    assert [step for step, _ in rows[0]] == [4, 8] and [step for step, _ in rows[1]] == [4, 8]
    assert [value for _, value in rows[0]] == pytest.approx([1.0, 1.0])
    assert [value for _, value in rows[1]] == pytest.approx([0.5, 0.5], rel=1e-4)
    probe = engine._eigenvalue
    assert probe.values == pytest.approx([4.0, -2.0], rel=1e-4)
    by_block = {index: value for value, index in probe.block_eigenvalue.values()}
    assert len(probe.block_eigenvalue) == 4 and by_block == {0: 1.0, 1: pytest.approx(0.5, rel=1e-4)}
    _, plain = _train({}, steps=5)  # the extra backward passes and draws leave the training as it was
    for mine, theirs in zip(params, plain):
        torch.testing.assert_close(mine, theirs)


def test_at_zero_stage_2_the_values_and_the_training_are_the_same() -> None:
    """ZeRO's gradient hooks fire on accumulation into .grad, which the probe's torch.autograd.grad calls skip."""
    stage2 = {"zero_optimization": {"stage": 2}}
    engine, params = _train({"eigenvalue": EIGEN, **stage2}, steps=2)
    assert engine._eigenvalue.values == pytest.approx([4.0, -2.0], rel=1e-4)
    _, plain = _train(stage2, steps=2)
    for mine, theirs in zip(params, plain):
        torch.testing.assert_close(mine, theirs)

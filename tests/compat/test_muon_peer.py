"""Our MuonWithAuxAdam against DeepSpeed's (peer environment only: DeepSpeed is never a dependency): the same
parameters after three steps from the same gradients, a tall and a wide matrix (the shape scale) and two 1-D
parameters (the auxiliary AdamW), DeepSpeed's defaults otherwise."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from slipstream.optim.muon import MuonWithAuxAdam


def _peer_python() -> str | None:
    candidate = os.environ.get("SLIPSTREAM_PEER_PYTHON") or str(
        Path(__file__).resolve().parents[2] / ".bench-venv/bin/python"
    )
    return candidate if Path(candidate).is_file() else None


def test_muon_with_aux_adam_matches_deepspeed(tmp_path: Path) -> None:
    peer = _peer_python()
    if peer is None:
        pytest.skip("DeepSpeed peer environment absent (the comparison needs real DeepSpeed)")
    gen = torch.Generator().manual_seed(0)
    shapes = {"up.weight": (10, 6), "up.bias": (10,), "down.weight": (4, 10), "down.bias": (4,)}
    params = {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}
    grads = [{name: torch.randn(shape, generator=gen) for name, shape in shapes.items()} for _ in range(3)]
    torch.save({"params": params, "grads": grads, "muon_lr": 0.02, "adam_lr": 1e-3}, tmp_path / "inputs.pt")
    script = Path(__file__).parent / "peer" / "muon_in_deepspeed.py"
    done = subprocess.run([peer, str(script), "inputs.pt", "out.pt"], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    if done.returncode != 0 and "No module named 'deepspeed'" in done.stderr:
        pytest.skip("the peer interpreter has no DeepSpeed")
    assert done.returncode == 0, done.stderr[-4000:]
    theirs = torch.load(tmp_path / "out.pt")

    mine = {name: torch.nn.Parameter(value.clone()) for name, value in params.items()}
    optimizer = MuonWithAuxAdam([{"params": [p for p in mine.values() if p.dim() >= 2], "use_muon": True, "lr": 0.02},
                                 {"params": [p for p in mine.values() if p.dim() < 2], "use_muon": False,
                                  "lr": 1e-3}])
    for step_grads in grads:
        for name, p in mine.items():
            p.grad = step_grads[name].clone()
        optimizer.step()
    for name, p in mine.items():
        torch.testing.assert_close(p.detach(), theirs[name], rtol=0, atol=2e-5, msg=lambda m, n=name: f"{n}: {m}")
        assert float((p.detach() - params[name]).abs().max()) > 1e-3  # it moved

"""FusedAdam on a torch without Adam(decoupled_weight_decay=...) (before 2.6) decays the weights itself: the same
steps as torch's AdamW, with the param group's weight_decay left as given."""

from __future__ import annotations

import pytest
import torch

from slipstream.ops.adam import fused_adam


def test_adamw_math_without_torchs_decoupled_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused_adam, "_TORCH_DECOUPLES", False)
    torch.manual_seed(0)
    mine = torch.nn.Parameter(torch.randn(7))
    theirs = torch.nn.Parameter(mine.detach().clone())
    ours = fused_adam.FusedAdam([mine], lr=0.1, weight_decay=0.2)
    reference = torch.optim.AdamW([theirs], lr=0.1, weight_decay=0.2)
    for step in range(4):
        for param, optimizer in ((mine, ours), (theirs, reference)):
            param.grad = torch.full((7,), float(step + 1))
            optimizer.step()
    assert torch.allclose(mine, theirs, rtol=0, atol=1e-7)
    assert ours.param_groups[0]["weight_decay"] == 0.2 and ours.param_groups[0]["decoupled_weight_decay"] is True
    l2 = fused_adam.FusedAdam([torch.nn.Parameter(torch.ones(2))], adam_w_mode=False, weight_decay=0.2)
    assert not l2._decay_here  # Adam mode: torch's L2 term, on every torch

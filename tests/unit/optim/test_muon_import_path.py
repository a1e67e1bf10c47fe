"""Muon under DeepSpeed's import path (`deepspeed.runtime.zero.muon.muon_optimizer.MuonWithAuxAdam`)."""

from __future__ import annotations

import torch


def test_muon_with_aux_adam_under_deepspeeds_module() -> None:
    from slipstream.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam as Aliased

    from slipstream.optim.muon import MuonWithAuxAdam

    assert Aliased is MuonWithAuxAdam
    weight, bias = torch.nn.Parameter(torch.ones(3, 2)), torch.nn.Parameter(torch.ones(3))
    optimizer = Aliased([{"params": [weight], "use_muon": True}, {"params": [bias], "use_muon": False}])
    assert [g["use_muon"] for g in optimizer.param_groups] == [True, False]

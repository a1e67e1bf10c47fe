"""Muon's param groups as DeepSpeed builds them (the tag rule, muon_lr / adam_lr / group overrides, refusals by
name), the Newton-Schulz iteration's result, and LAMB's DeepSpeed surface (the FusedLamb alias, its
coefficients) on one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from slipstream.optim.lamb import FusedLamb
from slipstream.optim.muon import MuonWithAuxAdam, build_muon, newton_schulz, tag_muon_params


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(11, 6)
        self.hidden = nn.Linear(6, 6)
        self.lm_head = nn.Linear(6, 11, bias=False)


def test_groups_split_by_the_tag_rule_with_muon_lr_adam_lr_and_group_overrides() -> None:
    model = Tiny()
    tag_muon_params(model)
    assert [n for n, p in model.named_parameters() if p.use_muon] == ["hidden.weight"]  # type: ignore[attr-defined]
    groups = [{"params": [model.hidden.weight, model.hidden.bias], "momentum": 0.9},
              {"params": [model.embed_tokens.weight, model.lm_head.weight], "weight_decay": 0.0}]
    opt = build_muon(groups, {"lr": 0.5, "muon_lr": 0.03, "adam_lr": 0.002, "weight_decay": 0.1, "betas": [0.8, 0.9]})
    assert isinstance(opt, MuonWithAuxAdam)
    muon, adam, adam2 = opt.param_groups
    assert muon["use_muon"] and muon["lr"] == 0.03 and muon["momentum"] == 0.9 and muon["weight_decay"] == 0.1
    assert muon["ns_steps"] == 5 and muon["nesterov"] is True and muon["ns_method"] == "gram"
    assert not adam["use_muon"] and adam["lr"] == 0.002 and tuple(adam["betas"]) == (0.8, 0.9) and adam["eps"] == 1e-10
    assert adam["params"] == [model.hidden.bias] and adam2["weight_decay"] == 0.0 and len(adam2["params"]) == 2
    plain = build_muon(list(model.parameters()), {})
    assert [g["lr"] for g in plain.param_groups] == [0.02, 3e-4]  # DeepSpeed's defaults
    assert tuple(plain.param_groups[1]["betas"]) == (0.9, 0.95)


@pytest.mark.parametrize(
    ("options", "refusal"),
    [({"per_head_muon": True}, "per_head_muon is not implemented"), ({"ns_step": 5}, r"\['ns_step'\] not accepted"),
     ({"ns_method": "svd"}, "ns_method='svd'")],
)
def test_refusals_name_the_key(options: dict, refusal: str) -> None:
    model = Tiny()
    tag_muon_params(model)
    with pytest.raises(ValueError, match=refusal):
        build_muon(list(model.parameters()), options)
    with pytest.raises(ValueError, match="tagged with use_muon"):
        build_muon([nn.Parameter(torch.zeros(2, 2))], {})


def test_newton_schulz_is_near_orthogonal_and_scaled_by_shape() -> None:
    g = torch.randn(24, 8, generator=torch.Generator().manual_seed(0))
    out = newton_schulz(g, steps=5)
    singular = torch.linalg.svdvals(out / (24 / 8) ** 0.5)
    assert out.shape == g.shape and float(singular.min()) > 0.5 and float(singular.max()) < 1.5
    wide = newton_schulz(g.T, steps=5)  # no scale when rows <= cols
    torch.testing.assert_close(wide, out.T / (24 / 8) ** 0.5, rtol=1e-4, atol=1e-5)


def test_fused_lamb_alias_and_coefficients() -> None:
    import slipstream.ops.lamb as lamb_module
    from slipstream.runtime.zero.utils import is_zero_supported_optimizer

    assert lamb_module.FusedLamb is FusedLamb
    p, q = nn.Parameter(torch.ones(4)), nn.Parameter(torch.zeros(3))
    opt = FusedLamb([p, q], lr=0.1)
    assert is_zero_supported_optimizer(opt)  # ZeRO steps it without zero_allow_untested_optimizer
    p.grad, q.grad = torch.full((4,), 0.5), torch.ones(3)
    opt.step()
    # u = 0.05 / sqrt(0.00025) = sqrt(10) per element, ||p|| = 2: ratio 2 / (2 sqrt(10)); q's weight norm 0: ratio 1
    assert opt.get_lamb_coeffs() == pytest.approx([10**-0.5, 1.0], rel=1e-5)
    step = 0.1 * (0.001**0.5 / 0.1) * 10**-0.5 * 10**0.5  # step size x ratio x u
    torch.testing.assert_close(p.detach(), torch.full((4,), 1.0 - step), rtol=1e-5, atol=1e-6)


class TinyLM(Tiny):
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.tanh(self.hidden(self.embed_tokens(tokens))))


def test_the_planner_counts_muon_state_as_the_engine_holds_it() -> None:
    import slipstream
    from slipstream.planner.engine_hooks import engine_estimate

    config = {"train_batch_size": 2, "optimizer": {"type": "Muon", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 1}}
    engine, *_ = slipstream.initialize(model=TinyLM(), config=config)
    tokens = torch.tensor([[1, 2, 3], [4, 5, 6]])
    engine.backward(engine(tokens).square().mean())
    engine.step()
    held = engine.optimizer.owned_bytes()["optimizer_state"]
    # one momentum buffer for hidden.weight (36), two Adam moments for the rest (66 + 66 + 6), fp32
    assert held == (36 + 2 * (66 + 66 + 6)) * 4
    assert engine_estimate(plan=engine.plan, model=engine.module, world_size=1).owned["optimizer_state"] == held
    engine.destroy()


def test_nvme_offload_and_expert_groups_are_refused_by_name() -> None:
    from slipstream.zero.whole_tensors import attach_whole_tensors

    class Zero:  # what attach_whole_tensors reads first of a ZeRO optimizer
        optimizer = FusedLamb([nn.Parameter(torch.ones(2))])

        def __init__(self, other_groups: bool) -> None:
            self.other = other_groups

        def _other_groups(self) -> bool:
            return self.other

    with pytest.raises(ValueError, match="FusedLamb.*offload_optimizer.device 'nvme'"):
        attach_whole_tensors(Zero(False), offload_in_files=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="FusedLamb with param groups reduced over other process groups"):
        attach_whole_tensors(Zero(True), offload_in_files=False)  # type: ignore[arg-type]


def test_plain_matrices_step_whole_without_zero() -> None:
    """Outside ZeRO each parameter is its own whole tensor, matrices included (no flattening mistakes)."""
    gen = torch.Generator().manual_seed(1)
    w, g = torch.randn(5, 3, generator=gen), torch.randn(5, 3, generator=gen)
    p = nn.Parameter(w.clone())
    p.grad = g.clone()
    MuonWithAuxAdam([{"params": [p], "use_muon": True, "lr": 0.1}]).step()
    torch.testing.assert_close(p.detach(), w - 0.1 * newton_schulz(0.05 * g + 0.95 * (0.05 * g), steps=5))
    q = nn.Parameter(w.clone())
    q.grad = g.clone()
    FusedLamb([q], lr=0.1, weight_decay=0.5).step()
    u = 0.1 * g / (0.001**0.5 * g.abs() + 1e-8) + 0.5 * w  # first step: m = 0.1 g, sqrt(v) = sqrt(0.001) |g|
    ratio = min(max(float(w.norm() / u.norm()), 0.01), 10.0)
    torch.testing.assert_close(q.detach(), w - 0.1 * (0.001**0.5 / 0.1) * ratio * u)

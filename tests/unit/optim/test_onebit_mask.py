"""The 1-bit optimizers' DeepSpeed surface that the acceptance suite reads: a param group's `exp_avg_mask`
(against a reference written out here; cut into ZeRO-0 pieces; kept by checkpoints as DeepSpeed keeps it),
`adam_freeze_key` / `lamb_freeze_key`, 1-bit LAMB without empty parameters, and Muon's `original_muon.muon_update`.

One rank: the 1-bit mean of one rank is the values themselves, so what the mask does is all that changes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import slipstream
from slipstream.optim.onebit import OneBitAdam, OneBitLamb, ZeroOneAdam

BETA1, BETA2, EPS, LR, WD = 0.9, 0.999, 1e-8, 0.05, 0.01


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    """A one-rank gloo group (the compressed all-reduce asks for one)."""
    if dist.is_initialized():  # an engine's one-rank group from an earlier test
        yield
        return
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [
        torch.nn.Parameter(torch.randn(3, 4)),
        torch.nn.Parameter(torch.randn(5)),
        torch.nn.Parameter(torch.randn(2)),
    ]


def _grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(3, 4, generator=g), torch.randn(5, generator=g), torch.randn(2, generator=g)]


def _mask() -> torch.Tensor:
    """Over group 0's two parameters flattened in order (12 + 5 elements): zeros in both."""
    mask = torch.ones(17)
    mask[[0, 5, 11, 12, 16]] = 0.0
    return mask


def test_onebit_adam_masks_the_compressed_momentum_as_the_reference(one_rank: None) -> None:
    params = _params()
    groups = [{"params": params[:2], "exp_avg_mask": _mask()}, {"params": params[2:]}]
    optimizer = OneBitAdam(groups, lr=LR, weight_decay=WD, freeze_step=2)
    ref = [p.detach().clone() for p in params]
    m = [torch.zeros_like(p) for p in ref]
    v = [torch.zeros_like(p) for p in ref]
    masks = [_mask()[:12].view(3, 4), _mask()[12:], None]
    for step in range(1, 6):
        for p, g in zip(params, _grads(step)):
            p.grad = g.clone()
        optimizer.step()
        for k, g in enumerate(_grads(step)):  # DeepSpeed's 1-bit Adam, written out
            m[k] = BETA1 * m[k] + (1 - BETA1) * g
            if step <= 2:
                v[k] = BETA2 * v[k] + (1 - BETA2) * g * g
            elif masks[k] is not None:
                m[k] = m[k] * masks[k]
            ref[k] = ref[k] - LR * (m[k] / (v[k].sqrt() + EPS) + WD * ref[k])
    for p, r, mk in zip(params, ref, m):
        torch.testing.assert_close(p.detach(), r, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(optimizer.state[p]["exp_avg"], mk, rtol=1e-5, atol=1e-7)
    assert optimizer.state[params[0]]["exp_avg"].view(-1)[[0, 5, 11]].eq(0).all()


@pytest.mark.parametrize("cls", [OneBitLamb, ZeroOneAdam])
def test_lamb_and_zero_one_adam_keep_masked_momentum_at_zero(one_rank: None, cls: type) -> None:
    """1-bit LAMB masks its compressed momentum; 0/1 Adam (interval 1 after step 1) its synchronised update, so
    the masked elements of its parameters stop moving and their momentum is zero."""
    params = _params()
    groups = [{"params": params[:2], "exp_avg_mask": _mask()}, {"params": params[2:]}]
    schedule = {"freeze_step": 1} if cls is OneBitLamb else {"var_freeze_step": 0}
    optimizer = cls(groups, lr=LR, weight_decay=WD, **schedule)
    before = None
    for step in range(1, 5):
        for p, g in zip(params, _grads(step)):
            p.grad = g.clone()
        optimizer.step()
        before = before or [p.detach().clone() for p in params]
    flat = torch.cat([optimizer.state[p]["exp_avg"].view(-1) for p in params[:2]])
    masked = _mask() == 0
    assert flat[masked].eq(0).all() and flat[~masked].ne(0).all()
    moved = torch.cat([(p.detach() - b).view(-1) for p, b in zip(params[:2], before)]).abs()
    if cls is ZeroOneAdam:  # masked: only the rounding of p + move - move
        assert moved[masked].max() < 1e-6 and moved[~masked].min() > 1e-4


def test_a_mask_of_the_wrong_size_is_refused_by_name(one_rank: None) -> None:
    params = _params()
    optimizer = OneBitAdam([{"params": params[:2], "exp_avg_mask": torch.ones(12)}], freeze_step=0)
    for p, g in zip(params, _grads(1)):
        p.grad = g
    with pytest.raises(ValueError, match=r"param group 0's exp_avg_mask is \(12,\).*hold 17 elements"):
        optimizer.step()


def test_freeze_keys_say_when_warm_up_ended_and_follow_a_load(one_rank: None) -> None:
    for cls, key in ((OneBitAdam, "adam_freeze_key"), (OneBitLamb, "lamb_freeze_key")):
        params = _params()
        optimizer = cls([{"params": params}], freeze_step=2)
        seen = []
        for step in range(1, 4):
            for p, g in zip(params, _grads(step)):
                p.grad = g.clone()
            optimizer.step()
            seen.append(getattr(optimizer, key))
        assert seen == [False, True, True], cls.__name__
        saved = optimizer.state_dict()
        for freeze_step, over in ((20, False), (2, True)):
            later = cls([{"params": params}], freeze_step=freeze_step)
            later.load_state_dict(saved)
            assert getattr(later, key) is over
            if cls is OneBitLamb:  # the frozen ratios are kept past the warm-up, started again inside it
                assert any(name.endswith("lamb_coeff_freeze") for name in later.rank_tensors()) is over


def _engine(model: torch.nn.Module, mask: torch.Tensor | None, kind: str = "OneBitAdam") -> tuple:
    named = [p for _, p in model.named_parameters()]
    first: dict = {"params": named[:2]} | ({"exp_avg_mask": mask} if mask is not None else {})
    config = {"train_batch_size": 2, "optimizer": {"type": kind, "params": {"lr": LR, "freeze_step": 2}}}
    return slipstream.initialize(model=model, model_parameters=[first, {"params": named[2:]}], config=config)[:2]


def _train(engine: object, steps: int) -> None:
    torch.manual_seed(1)
    for _ in range(steps):
        loss = engine(torch.randn(2, 4)).square().mean()  # type: ignore[operator]
        engine.backward(loss)  # type: ignore[attr-defined]
        engine.step()  # type: ignore[attr-defined]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


def test_engine_cuts_the_mask_into_pieces_and_checkpoints_keep_the_live_one(tmp_path: Path) -> None:
    """ZeRO 0 steps one piece per group (weight 12 + bias 3 elements): the mask lines up with the piece; a save
    keeps the mask among the rank's tensors; a load keeps the live group's mask (another one, or none)."""
    mask1, mask2 = torch.ones(15), torch.ones(15)
    mask1[[1, 7, 13]], mask2[[2, 14]] = 0.0, 0.0
    model = _model()
    engine, optimizer = _engine(model, mask1)
    _train(engine, 4)
    (piece,) = optimizer.param_groups[0]["params"]
    in_piece = {part.tensor: part.offset for part in optimizer.whole_tensors().parts(piece)}  # ZeRO's layout
    flat = optimizer.state[piece]["exp_avg"].view(-1)
    momentum = torch.cat([flat[in_piece[0] : in_piece[0] + 12], flat[in_piece[1] : in_piece[1] + 3]])
    assert momentum[mask1 == 0].eq(0).all() and momentum[mask1 != 0].ne(0).all()
    engine.save_checkpoint(str(tmp_path), tag="t")
    assert torch.equal(optimizer.rank_tensors()["group0.exp_avg_mask"], mask1)
    manifest = next(tmp_path.rglob("manifest.json")).read_text()
    assert "optimizer_rank/0/group0.exp_avg_mask" in manifest
    engine.destroy()
    for live in (mask2, None):
        engine, optimizer = _engine(_model(), live)
        engine.load_checkpoint(str(tmp_path), tag="t")
        group = optimizer.param_groups[0]
        assert torch.equal(group["exp_avg_mask"], live) if live is not None else "exp_avg_mask" not in group
        assert optimizer.adam_freeze_key is True
        engine.destroy()


def test_state_dict_load_keeps_the_live_mask(one_rank: None) -> None:
    params = _params()
    first = OneBitAdam([{"params": params[:2], "exp_avg_mask": _mask()}], freeze_step=0)
    saved = first.state_dict()
    assert torch.equal(saved["param_groups"][0]["exp_avg_mask"], _mask())
    other = torch.ones(17)
    other[3] = 0.0
    second = OneBitAdam([{"params": params[:2], "exp_avg_mask": other}], freeze_step=0)
    second.load_state_dict(saved)
    assert torch.equal(second.param_groups[0]["exp_avg_mask"], other)
    third = OneBitAdam([{"params": params[:2]}], freeze_step=0)
    third.load_state_dict(saved)
    assert "exp_avg_mask" not in third.param_groups[0]


def test_onebit_lamb_leaves_out_empty_parameters_and_groups(one_rank: None) -> None:
    weight, empty = torch.nn.Parameter(torch.ones(2, 3)), torch.nn.Parameter(torch.empty(0, 3))
    bias = torch.nn.Parameter(torch.ones(2))
    groups = [{"params": [weight, empty, bias], "weight_decay": 0.01}, {"params": [empty], "weight_decay": 0.0}]
    optimizer = OneBitLamb(groups, freeze_step=1)
    assert [[tuple(p.shape) for p in g["params"]] for g in optimizer.param_groups] == [[(2, 3), (2,)]]
    assert optimizer.param_groups[0]["weight_decay"] == 0.01
    assert [tuple(p.shape) for p in OneBitLamb([empty, bias]).param_groups[0]["params"]] == [(2,)]
    for _ in range(3):
        weight.grad, bias.grad = torch.full((2, 3), 0.5), torch.full((2,), -0.5)
        optimizer.step()
    assert torch.isfinite(weight).all() and torch.isfinite(bias).all()


def _newton_schulz_reference(x: torch.Tensor, steps: int) -> torch.Tensor:
    a, b, c = 3.4445, -4.7750, 2.0315
    tall = x.shape[0] > x.shape[1]
    y = x.T if tall else x
    y = y / (torch.linalg.matrix_norm(y) + 1e-7)
    for _ in range(steps):
        s = y @ y.T
        y = a * y + (b * s + c * s @ s) @ y
    y = y.T if tall else y
    return y * max(1.0, x.shape[0] / x.shape[1]) ** 0.5


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_update_under_deepspeeds_module_path(nesterov: bool) -> None:
    from slipstream.runtime.zero.muon.original_muon import muon_update

    torch.manual_seed(0)
    grad, momentum = torch.randn(6, 3), torch.randn(6, 3)
    expected_momentum = momentum + (grad - momentum) * 0.05
    direction = grad + (expected_momentum - grad) * 0.95 if nesterov else expected_momentum
    expected = _newton_schulz_reference(direction, 5)
    update = muon_update(grad.clone(), momentum, beta=0.95, ns_steps=5, nesterov=nesterov)
    torch.testing.assert_close(momentum, expected_momentum)
    torch.testing.assert_close(update, expected, rtol=1e-4, atol=1e-5)
    experts = muon_update(torch.stack([grad, -grad]), torch.zeros(2, 6, 3), nesterov=False, is_expert_group=True)
    torch.testing.assert_close(experts[1], -experts[0])
    with pytest.raises(ValueError, match="ns_method='exact'"):
        muon_update(grad, momentum, ns_method="exact")


def test_non_freeze_is_reported_not_ignored() -> None:
    """DeepSpeed's per-group `non_freeze` (full-precision all-reduce after the warm-up) is not built: a warning
    names it (once per process; no other test sets it)."""
    with pytest.warns(UserWarning, match="param group 1 sets non_freeze"):
        OneBitAdam([{"params": _params()[:1]}, {"params": _params()[1:], "non_freeze": True}])

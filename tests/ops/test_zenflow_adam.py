"""ZenFlow's selective AdamW against torch.optim.AdamW run on the selected columns alone."""

from __future__ import annotations

import pytest
import torch

from slipstream.ops.adam import ZenFlowSelectiveAdamW, ZenFlowSelectiveAdamW_stage3

HYPER = dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)


def _grads(shape: tuple[int, ...], steps: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=gen) for _ in range(steps)]


def _reference(start: torch.Tensor, grads: list[torch.Tensor], **hyper) -> torch.Tensor:
    """torch's AdamW on a tensor of its own."""
    ref = torch.nn.Parameter(start.clone())
    opt = torch.optim.AdamW([ref], **{**HYPER, **hyper})
    for g in grads:
        ref.grad = g.clone()
        opt.step()
    return ref.detach()


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("offload", [False, True])
def test_selected_columns_follow_adamw_and_others_stay(offload: bool, amsgrad: bool) -> None:
    torch.manual_seed(1)
    param = torch.nn.Parameter(torch.randn(5, 8))
    start = param.detach().clone()
    cols = torch.tensor([1, 4, 6])
    grads = _grads((5, 3), 12)
    opt = ZenFlowSelectiveAdamW([param], offload=offload, amsgrad=amsgrad, **HYPER)
    if offload:
        param.exp_avg_cpu_data = torch.zeros(15)
        param.exp_avg_sq_cpu_data = torch.zeros(15)
    for g in grads:
        param.selected_indices = cols
        param.selected_grad = g.clone()
        opt.step()
        assert param.selected_grad is None
    expected = _reference(start[:, cols], grads, amsgrad=amsgrad)
    torch.testing.assert_close(param.detach()[:, cols], expected, rtol=1e-6, atol=1e-6)
    others = [c for c in range(8) if c not in cols.tolist()]
    assert torch.equal(param.detach()[:, others], start[:, others])
    assert opt.state[param]["step"].item() == 12
    if offload:  # the moments live in the host buffers, nowhere else
        assert "exp_avg" not in opt.state[param]
        assert param.exp_avg_cpu_data.abs().sum() > 0


@pytest.mark.parametrize("cls", [ZenFlowSelectiveAdamW, ZenFlowSelectiveAdamW_stage3])
def test_every_column_selected_is_adamw(cls: type) -> None:
    torch.manual_seed(2)
    weight = torch.randn(4, 6)
    bias = torch.randn(4)
    grads_w, grads_b = _grads((4, 6), 10, 3), _grads((4,), 10, 4)
    pw, pb = torch.nn.Parameter(weight.clone()), torch.nn.Parameter(bias.clone())
    if cls is ZenFlowSelectiveAdamW_stage3:
        for p, t in ((pw, weight.t().contiguous().view(-1)), (pb, bias.clone())):
            p.ds_tensor = t.clone()
            p.ds_shape = (6, 4) if p is pw else (4,)
            p.complete_column_offset, p.complete_numel, p.group_id = 0, p.numel(), 0
    opt = cls([pw, pb], **HYPER)
    for gw, gb in zip(grads_w, grads_b):
        pw.selected_indices = torch.arange(6)
        pb.selected_indices = torch.arange(4)
        pw.selected_grad = gw.t().clone() if cls is ZenFlowSelectiveAdamW_stage3 else gw.clone()
        pb.selected_grad = gb.clone()
        opt.step()
    got_w = pw.ds_tensor.view(6, 4).t() if cls is ZenFlowSelectiveAdamW_stage3 else pw.detach()
    got_b = pb.ds_tensor if cls is ZenFlowSelectiveAdamW_stage3 else pb.detach()
    torch.testing.assert_close(got_w, _reference(weight, grads_w), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_b, _reference(bias, grads_b), rtol=1e-6, atol=1e-6)


def test_snapshot_overrides_what_the_full_update_wrote() -> None:
    torch.manual_seed(5)
    param = torch.nn.Parameter(torch.randn(3, 5))
    start = param.detach().clone()
    cols = torch.tensor([0, 3])
    opt = ZenFlowSelectiveAdamW([param], **HYPER)
    param.selected_indices = cols
    param.selected_grad = torch.ones(3, 2)
    opt.temp_copy_param({0: [param]})
    param.data.add_(100.0)  # what a CPU update of the whole parameter would do
    opt.step()
    assert param.temp_selected_param is None
    expected = _reference(start[:, cols], [torch.ones(3, 2)])
    torch.testing.assert_close(param.detach()[:, cols], expected)
    assert torch.equal(param.detach()[:, [1, 2, 4]], start[:, [1, 2, 4]] + 100.0)


def test_clear_keeps_the_step_count() -> None:
    param = torch.nn.Parameter(torch.randn(2, 3))
    opt = ZenFlowSelectiveAdamW([param], **HYPER)
    for _ in range(3):
        param.selected_indices = torch.tensor([2])
        param.selected_grad = torch.randn(2, 1)
        opt.step()
    opt.clear_selected_mv()
    state = opt.state[param]
    assert state["exp_avg"].abs().sum() == 0 and state["exp_avg_sq"].abs().sum() == 0
    assert state["step"].item() == 3


def test_group_step_updates_only_the_given_params() -> None:
    a, b = torch.nn.Parameter(torch.randn(2, 4)), torch.nn.Parameter(torch.randn(2, 4))
    b_start = b.detach().clone()
    opt = ZenFlowSelectiveAdamW([a, b], **HYPER)
    for p in (a, b):
        p.selected_indices = torch.tensor([1])
        p.selected_grad = torch.randn(2, 1)
    a_start = a.detach().clone()
    opt.group_step({0: [a]})
    assert not torch.equal(a.detach(), a_start)
    assert torch.equal(b.detach(), b_start) and b.selected_grad is not None


def test_stage3_touches_only_its_range_of_the_partition() -> None:
    """A partition holding other data around the parameter: only the selected rows of its range change."""
    torch.manual_seed(6)
    weight = torch.randn(3, 4)  # 4 columns of 3 rows -> 12 elements at offset 5 of a 20-element partition
    part = torch.randn(20)
    part[5:17] = weight.t().reshape(-1)
    start = part.clone()
    p = torch.nn.Parameter(weight.clone())
    p.ds_tensor, p.ds_shape = part, (4, 3)
    p.complete_column_offset, p.complete_numel, p.group_id = 5, 12, 0
    opt = ZenFlowSelectiveAdamW_stage3([p], **HYPER)
    grads = _grads((2, 3), 4, 7)
    for g in grads:
        p.selected_indices = torch.tensor([1, 3])
        p.selected_grad = g.clone()
        opt.step()
    cols = part[5:17].view(4, 3)
    torch.testing.assert_close(cols[[1, 3]], _reference(weight.t()[[1, 3]], grads), rtol=1e-6, atol=1e-6)
    assert torch.equal(cols[[0, 2]], start[5:17].view(4, 3)[[0, 2]])
    assert torch.equal(part[:5], start[:5]) and torch.equal(part[17:], start[17:])


def test_wrong_gradient_shape_is_named() -> None:
    param = torch.nn.Parameter(torch.randn(2, 4))
    opt = ZenFlowSelectiveAdamW([param], **HYPER)
    param.selected_indices = torch.tensor([0, 1])
    param.selected_grad = torch.randn(2, 3)
    with pytest.raises(ValueError, match="selected_grad has shape"):
        opt.step()


def test_zenflow_cpu_adam_steps_at_the_given_step_number() -> None:
    """`step(step_id)` is DeepSpeedCPUAdam's update at that step number (its bias correction), whatever the
    number of updates before; with overlap_step it is DeepSpeedCPUAdam's own step."""
    from slipstream.ops.adam import DeepSpeedCPUAdam, ZenFlowCPUAdam

    torch.manual_seed(8)
    start, grads = torch.randn(19), _grads((19,), 2, 9)
    ours = torch.nn.Parameter(start.clone())
    opt = ZenFlowCPUAdam([ours], lr=1e-2)
    for g, step_id in zip(grads, (4, 8)):  # two updates at ZenFlow steps 4 and 8
        ours.grad = g.clone()
        opt.step(step_id)
    assert opt.state[ours]["step"].item() == 8
    expected = torch.nn.Parameter(start.clone())
    ref = DeepSpeedCPUAdam([expected], lr=1e-2)
    for g, step_id in zip(grads, (4, 8)):
        expected.grad = g.clone()
        ref.state[expected].setdefault("step", torch.tensor(0.0))
        if "exp_avg" not in ref.state[expected]:
            ref.state[expected].update(exp_avg=torch.zeros(19), exp_avg_sq=torch.zeros(19))
        ref.state[expected]["step"].fill_(step_id - 1)
        ref.step()
    torch.testing.assert_close(ours.detach(), expected.detach(), rtol=0, atol=0)
    plain = ZenFlowCPUAdam([torch.nn.Parameter(start.clone())], lr=1e-2, overlap_step=True)
    assert "step" not in vars(plain)  # DeepSpeedCPUAdam's own step

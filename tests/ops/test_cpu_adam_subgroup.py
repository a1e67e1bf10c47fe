"""DeepSpeedCPUAdam.step_subgroup / rollback_subgroup (DeepSpeed's SuperOffload entry points): a sub-group's step
equals torch's Adam/AdamW step, each sub-group keeps its own state, and a rollback with the same gradient returns
the parameter and both moments to their values before the step."""

from __future__ import annotations

import pytest
import torch

from slipstream.ops.adam import DeepSpeedCPUAdam


@pytest.mark.parametrize(
    "adamw_mode,decay,bias_correction", [(True, 0.01, True), (False, 0.01, True), (True, 0.0, False)]
)
def test_step_matches_torch_and_rollback_undoes_it(adamw_mode: bool, decay: float, bias_correction: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(257, generator=gen))
    optimizer = DeepSpeedCPUAdam(
        [param], lr=1e-2, weight_decay=decay, adamw_mode=adamw_mode, bias_correction=bias_correction
    )
    history = []
    for _ in range(3):
        param.grad = torch.randn(257, generator=gen)
        history.append((param.detach().clone(), param.grad.clone()))
        optimizer.step_subgroup(0)
    state = optimizer.state[0]
    assert int(state["step"]) == 3 and set(state) == {"step", "exp_avg", "exp_avg_sq"}
    if bias_correction:  # same trajectory as torch's optimizer
        ref = torch.nn.Parameter(history[0][0].clone())
        cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
        torch_opt = cls([ref], lr=1e-2, weight_decay=decay)
        for _, grad in history:
            ref.grad = grad
            torch_opt.step()
        torch.testing.assert_close(param.detach(), ref.detach(), rtol=1e-5, atol=1e-6)
    for before, grad in reversed(history):  # undo the steps one by one
        param.grad = grad
        optimizer.rollback_subgroup(0)
        # fp32: recovering v subtracts (1 - beta2) g^2 from a value of that size, so an element can lose ~4 digits
        torch.testing.assert_close(param.detach(), before, rtol=1e-4, atol=1e-4)
    assert int(state["step"]) == 0
    torch.testing.assert_close(state["exp_avg"], torch.zeros(257), rtol=0, atol=1e-5)
    torch.testing.assert_close(state["exp_avg_sq"], torch.zeros(257), rtol=0, atol=1e-7)


def test_subgroups_are_independent_and_errors_are_named() -> None:
    param = torch.nn.Parameter(torch.randn(64))
    optimizer = DeepSpeedCPUAdam([param])
    with pytest.raises(RuntimeError, match="Cannot rollback optimizer state for sub_group_id 0"):
        optimizer.rollback_subgroup(0)
    param.grad = torch.randn(64)
    optimizer.step_subgroup(0)
    optimizer.step_subgroup(1)
    optimizer.step_subgroup(0)
    assert int(optimizer.state[0]["step"]) == 2 and int(optimizer.state[1]["step"]) == 1
    optimizer.rollback_subgroup(1)
    with pytest.raises(RuntimeError, match="Cannot rollback sub_group_id 1: step count is 0"):
        optimizer.rollback_subgroup(1)
    two = DeepSpeedCPUAdam([torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4))])
    for p in two.param_groups[0]["params"]:
        p.grad = torch.randn(4)
    with pytest.raises(ValueError, match="one flat parameter with a gradient; this optimizer has 2"):
        two.step_subgroup(0)

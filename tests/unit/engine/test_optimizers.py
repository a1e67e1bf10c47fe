"""build_optimizer / build_scheduler by name, and our Lamb and Lion against updates written out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from slipstream.config.plan import OptimizerPlan, SchedulerPlan
from slipstream.engine.lr_schedules import WarmupDecayLR, WarmupLR
from slipstream.engine.optimizers import Lamb, Lion, build_optimizer, build_scheduler
from slipstream.ops.adam import DeepSpeedCPUAdam, FusedAdam


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(2, 3))]


def _build(name: str, on_host: bool = False, **params: object) -> torch.optim.Optimizer:
    return build_optimizer(OptimizerPlan(name=name, params=dict(params)), _params(), on_host=on_host)


def test_adamw_and_adam_by_name() -> None:
    adamw = _build("adamw", lr=0.01, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1)
    assert type(adamw) is FusedAdam and adamw.adam_w_mode  # DeepSpeed's class name, torch's fused kernel
    group = adamw.param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (0.01, (0.8, 0.9), 1e-6, 0.1)
    assert group["fused"] is True and group["decoupled_weight_decay"] is True  # torch: fused AdamW on CPU
    adam = _build("adam", lr=0.02)
    assert type(adam) is FusedAdam and adam.param_groups[0]["lr"] == 0.02
    assert adam.param_groups[0]["decoupled_weight_decay"] is False  # L2 decay, as torch.optim.Adam
    assert type(_build("adamw", torch_adam=True)) is torch.optim.AdamW  # DeepSpeed's torch_adam


def test_user_choice_of_foreach_is_kept() -> None:
    opt = _build("adamw", foreach=True)
    assert opt.param_groups[0]["foreach"] is True and not opt.param_groups[0]["fused"]


def test_cpu_offload_builds_cpu_adam_with_mode() -> None:
    adamw = _build("adamw", on_host=True, lr=0.003, weight_decay=0.01)
    assert type(adamw) is DeepSpeedCPUAdam and adamw.adamw_mode is True
    assert adamw.param_groups[0]["lr"] == 0.003
    adam = _build("adam", on_host=True, bias_correction=False)
    assert type(adam) is DeepSpeedCPUAdam and adam.adamw_mode is False
    assert adam.param_groups[0]["bias_correction"] is False


def test_bias_correction_false_without_offload_is_refused() -> None:
    with pytest.raises(ValueError, match="bias_correction"):
        _build("adamw", bias_correction=False)
    assert type(_build("adamw", bias_correction=True)) is FusedAdam


@pytest.mark.parametrize(
    ("name", "cls", "params"),
    [
        ("sgd", torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
        ("adagrad", torch.optim.Adagrad, {"lr": 0.05}),
        ("lamb", Lamb, {"lr": 0.01, "max_coeff": 5.0}),
        ("lion", Lion, {"lr": 1e-4, "betas": (0.9, 0.99)}),
        ("RMSprop", torch.optim.RMSprop, {"lr": 0.01, "alpha": 0.9}),
    ],
)
def test_each_name_builds_its_class(name: str, cls: type, params: dict) -> None:
    opt = _build(name, **params)
    assert type(opt) is cls
    for key, value in params.items():
        assert opt.param_groups[0][key] == value


def test_unknown_optimizer_name_lists_supported() -> None:
    with pytest.raises(ValueError, match=r"optimizer.type='muadam'.*'adamw'.*'lion'"):
        _build("muadam")
    with pytest.raises(ValueError, match="optimizer.type='Optimizer'"):
        _build("Optimizer")  # the abstract base is not an optimizer one can build


def test_unknown_optimizer_param_names_it_and_the_accepted_ones() -> None:
    with pytest.raises(
        ValueError, match=r"\['momentum'\] not accepted by slipstream.ops.adam.fused_adam.FusedAdam.*'betas'"
    ):
        _build("adamw", momentum=0.9)
    with pytest.raises(ValueError, match=r"\['beta'\] not accepted by .*Lion.*'betas'"):
        _build("lion", beta=0.9)
    with pytest.raises(ValueError, match=r"\['adamw_mode'\] not accepted by .*DeepSpeedCPUAdam"):
        _build("adamw", on_host=True, adamw_mode=False)


def _one_tensor(values: list[float]) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.tensor(values, dtype=torch.float64))


def test_lamb_step_matches_hand_update() -> None:
    p = _one_tensor([1.0, -2.0, 3.0])
    opt = Lamb([p], lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    g = [0.5, 0.1, -0.2]
    p.grad = torch.tensor(g, dtype=torch.float64)
    opt.step()
    w = [1.0, -2.0, 3.0]
    # DeepSpeed's kernel: u from the moments as they are (m = 0.1 g, v = 0.001 g^2), the bias correction a factor
    # sqrt(1 - 0.999) / (1 - 0.9) of the step size, outside the trust ratio
    u = [0.1 * gi / (math.sqrt(0.001 * gi * gi) + 1e-8) + 0.01 * wi for gi, wi in zip(g, w)]
    w_norm = math.sqrt(sum(x * x for x in w))
    u_norm = math.sqrt(sum(x * x for x in u))
    ratio = min(max(w_norm / u_norm, 0.01), 10.0)
    step_size = 0.1 * math.sqrt(1 - 0.999) / (1 - 0.9)
    expected = [wi - step_size * ratio * ui for wi, ui in zip(w, u)]
    assert p.detach().tolist() == pytest.approx(expected, rel=1e-9)
    assert opt.state[p]["step"] == 1


def test_lamb_trust_ratio_clamps_and_eps_inside_sqrt() -> None:
    step_size = 0.1 * math.sqrt(1 - 0.999) / (1 - 0.9)
    p = _one_tensor([300.0, 400.0])  # ||w|| = 500; u ~ (3.2, 3.2), ratio 500 / 4.5 > max_coeff
    opt = Lamb([p], lr=0.1, max_coeff=10.0)
    p.grad = torch.tensor([1.0, 1.0], dtype=torch.float64)
    opt.step()
    u = 0.1 / (math.sqrt(0.001) + 1e-8)
    expected = [300.0 - step_size * 10.0 * u, 400.0 - step_size * 10.0 * u]
    assert p.detach().tolist() == pytest.approx(expected, rel=1e-12)

    q = _one_tensor([0.003, 0.004])  # ||w|| = 0.005; ratio 0.005 / 0.28 < min_coeff
    opt = Lamb([q], lr=0.1, eps=0.25, eps_inside_sqrt=True, min_coeff=0.05)
    q.grad = torch.tensor([1.0, -1.0], dtype=torch.float64)
    opt.step()
    u1 = 0.1 / math.sqrt(0.001 + 0.25)  # m / sqrt(v + eps)
    expected = [0.003 - step_size * 0.05 * u1, 0.004 + step_size * 0.05 * u1]
    assert q.detach().tolist() == pytest.approx(expected, rel=1e-12)


def test_lamb_zero_weights_use_ratio_one() -> None:
    p = _one_tensor([0.0, 0.0])
    opt = Lamb([p], lr=0.5, bias_correction=False)
    p.grad = torch.tensor([2.0, -2.0], dtype=torch.float64)
    opt.step()
    # no bias correction: m = 0.2, v = 0.004; u = 0.2 / (sqrt(0.004) + 1e-8)
    u = 0.2 / (math.sqrt(0.001 * 4.0) + 1e-8)
    assert p.detach().tolist() == pytest.approx([-0.5 * u, 0.5 * u], rel=1e-9)


def test_lion_two_steps_match_hand_update() -> None:
    p = _one_tensor([1.0, -2.0, 3.0])
    opt = Lion([p], lr=0.1, betas=(0.9, 0.99), weight_decay=0.1)
    g1, g2 = [0.5, -0.1, 0.0], [-0.5, 0.2, 1.0]
    p.grad = torch.tensor(g1, dtype=torch.float64)
    opt.step()
    sign = [1.0, -1.0, 0.0]  # sign(0.9 * 0 + 0.1 * g1)
    w1 = [wi * (1 - 0.1 * 0.1) - 0.1 * si for wi, si in zip([1.0, -2.0, 3.0], sign)]
    assert p.detach().tolist() == pytest.approx(w1, rel=1e-12)
    m1 = [0.01 * gi for gi in g1]  # 0.99 * 0 + 0.01 * g1
    p.grad = torch.tensor(g2, dtype=torch.float64)
    opt.step()
    c = [0.9 * mi + 0.1 * gi for mi, gi in zip(m1, g2)]  # [-0.0455, 0.0191, 0.1]
    sign2 = [math.copysign(1.0, ci) for ci in c]
    w2 = [wi * (1 - 0.1 * 0.1) - 0.1 * si for wi, si in zip(w1, sign2)]
    assert p.detach().tolist() == pytest.approx(w2, rel=1e-12)
    assert opt.state[p]["exp_avg"].tolist() == pytest.approx([0.99 * mi + 0.01 * gi for mi, gi in zip(m1, g2)])


def _sgd() -> torch.optim.Optimizer:
    return torch.optim.SGD(_params(), lr=0.1)


def test_build_scheduler_deepspeed_and_torch_names() -> None:
    sched = build_scheduler(
        SchedulerPlan(name="WarmupLR", params={"warmup_max_lr": 0.01, "warmup_num_steps": 5}), _sgd()
    )
    assert type(sched) is WarmupLR and sched.warmup_num_steps == 5
    plan = SchedulerPlan(name="WarmupDecayLR", params={"total_num_steps": 50, "warmup_num_steps": 10})
    decay = build_scheduler(plan, _sgd())
    assert type(decay) is WarmupDecayLR and decay.total_num_steps == 50
    step_lr = build_scheduler(SchedulerPlan(name="StepLR", params={"step_size": 3, "gamma": 0.5}), _sgd())
    assert type(step_lr) is torch.optim.lr_scheduler.StepLR and step_lr.step_size == 3


def test_build_scheduler_errors() -> None:
    with pytest.raises(ValueError, match=r"scheduler.type='Warmup'.*WarmupCosineLR.*StepLR"):
        build_scheduler(SchedulerPlan(name="Warmup", params={}), _sgd())
    with pytest.raises(ValueError, match=r"\['warmup_steps'\] not accepted by .*WarmupLR.*'warmup_num_steps'"):
        build_scheduler(SchedulerPlan(name="WarmupLR", params={"warmup_steps": 10}), _sgd())
    with pytest.raises(ValueError, match=r"missing \['total_num_steps'\]"):
        build_scheduler(SchedulerPlan(name="WarmupCosineLR", params={}), _sgd())
    with pytest.raises(ValueError, match=r"missing \['step_size'\]"):
        build_scheduler(SchedulerPlan(name="StepLR", params={}), _sgd())


@pytest.mark.parametrize("cls", [Lamb, Lion])
def test_step_returns_the_closure_loss_and_skips_params_without_grads(cls: type[torch.optim.Optimizer]) -> None:
    used, unused = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    opt = cls([{"params": [unused]}, {"params": [used]}], lr=0.1)

    def closure() -> float:
        loss = (used * 2.0).sum()
        loss.backward()  # the closure runs with autograd on, though step() is under no_grad
        return float(loss)

    assert opt.step(closure) == 6.0
    assert torch.equal(unused, torch.ones(2)) and not opt.state[unused]
    assert not torch.equal(used, torch.ones(3)) and opt.state[used]
    assert opt.step() is None


def test_lamb_rejects_sparse_gradients() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        Lamb([p]).step()

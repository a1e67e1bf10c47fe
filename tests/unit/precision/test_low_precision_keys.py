"""The low-precision keys beyond the parameter dtype, on a one-process engine: `data_types.buffer_dtype` casts the
floating-point buffers, `bf16.immediate_grad_update` adds each bf16 gradient into the fp32 accumulator as it
is produced, and `bf16.stochastic_rounding` (Slipstream's own) rounds the bf16 master update without bias, so
an update below half a bf16 step moves the masters where rounding to nearest never does."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import slipstream
from slipstream.config import ConfigError, resolve
from slipstream.precision.buffers import cast_buffers
from slipstream.precision.masters import apply_state_dtype, stochastic_round_

BF16_STATES = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}


def _config(**extra: object) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
        **extra,
    }


class ScaledByBuffer(nn.Module):
    """A Linear whose output is multiplied by a registered buffer (as a rotary cache is used) plus an integer
    buffer that no dtype applies to."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 1.0 / 3.0))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale.to(x.dtype)


@pytest.mark.parametrize("stage", [0, 3])
def test_buffer_dtype_casts_floating_buffers(stage: int) -> None:
    engine, *_ = slipstream.initialize(
        model=ScaledByBuffer(),
        config=_config(data_types={"buffer_dtype": "bfloat16"}, zero_optimization={"stage": stage}),
    )
    assert engine.module.scale.dtype == torch.bfloat16 and engine.module.count.dtype == torch.long
    x = torch.randn(4, 4)
    with torch.no_grad():
        engine.eval()
        from slipstream.zero import GatheredParameters

        with GatheredParameters(list(engine.module.parameters())):
            want = engine.module.linear(x) * torch.tensor(1.0 / 3.0).bfloat16().float()
        got = engine(x)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)  # the buffer's bf16 value, not fp32's 1/3
    plain, *_ = slipstream.initialize(model=ScaledByBuffer(), config=_config(zero_optimization={"stage": stage}))
    assert plain.module.scale.dtype == torch.float32  # without the key, as placed
    assert cast_buffers(ScaledByBuffer(), None) == 0 and cast_buffers(ScaledByBuffer(), "fp16") == 1


def test_immediate_grad_update_accumulates_each_bf16_gradient_in_fp32() -> None:
    """Two micro-batches at ZeRO-1 with bf16 parameters (DeepSpeed's BF16_Optimizer case): after each backward
    the bf16 gradient is gone and the fp32 accumulator holds the fp32 sum of the bf16 gradients so far."""
    config = _config(
        bf16={"enabled": True, "immediate_grad_update": True},
        zero_optimization={"stage": 1},
        gradient_accumulation_steps=2,
    )
    assert not resolve(config, world_size=1).unimplemented
    model = nn.Linear(64, 64, bias=False)
    engine, *_ = slipstream.initialize(model=model, config=config)
    reference = nn.Linear(64, 64, bias=False).bfloat16()
    reference.weight.data.copy_(engine.module.weight.detach())
    flat = engine.optimizer.groups[0]
    want = torch.zeros(64 * 64)
    for seed in (1, 2):
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(seed)) * 3
        engine.backward(engine(x).float().pow(2).sum())
        reference.weight.grad = None
        reference(x.bfloat16()).float().pow(2).sum().backward()
        want += reference.weight.grad.float().reshape(-1)  # each bf16 gradient, summed in fp32
        assert engine.module.weight.grad is None
        assert flat.grad_storage.dtype == torch.float32
        torch.testing.assert_close(flat.full_grad_view(0), want, rtol=0, atol=0)
    assert not torch.equal(want.bfloat16().float(), want)  # a bf16 accumulator would have lost bits


def test_stochastic_rounding_is_unbiased_on_known_inputs() -> None:
    generator = torch.Generator().manual_seed(0)
    ulp = 2.0**-7  # bf16's step in [1, 2)
    values = torch.tensor([1.0 + 0.25 * ulp, 1.0 + 0.5 * ulp, -(1.0 + 0.75 * ulp), 1.5, float("inf")])
    out = torch.empty(20000, 5, dtype=torch.bfloat16)
    for row in out:
        stochastic_round_(row, values.clone(), generator)
    assert set(out[:, 0].float().tolist()) == {1.0, 1.0 + ulp}  # one of the two neighbours, nothing else
    mean = out[:, :4].double().mean(dim=0)
    torch.testing.assert_close(mean, values[:4].double(), rtol=0, atol=0.02 * ulp)  # 20000 draws: std 0.0035 ulp
    assert (out[:, 3] == 1.5).all() and (out[:, 4] == float("inf")).all()  # exact values and inf unchanged


def _train_small_updates(rounding: bool, stage: int) -> tuple[torch.Tensor, torch.Tensor]:
    """20 AdamW steps of lr 1e-3 (a constant gradient: each update is -lr exactly) on weights of 1.25, where a
    bf16 step is 2^-7 = 7.8e-3: rounding to nearest loses every update, stochastic rounding keeps them on
    average."""
    model = nn.Linear(256, 16, bias=False)
    nn.init.constant_(model.weight, 1.25)
    engine, *_ = slipstream.initialize(
        model=model,
        config=_config(bf16={**BF16_STATES, "stochastic_rounding": rounding}, zero_optimization={"stage": stage}),
    )
    start = engine.module.weight.detach().float().clone()
    for _ in range(20):
        engine.backward(engine(torch.ones(4, 256)).float().sum())
        engine.step()
    return start, engine.module.weight.detach().float()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stochastic_rounding_keeps_updates_below_half_a_bf16_step(stage: int) -> None:
    start, nearest = _train_small_updates(False, stage)
    assert torch.equal(nearest, start)  # every update rounded away
    start, stochastic = _train_small_updates(True, stage)
    moved = (start - stochastic).mean().item()
    assert abs(moved - 20 * 1e-3) < 0.1 * 20 * 1e-3, moved  # 4096 weights: the mean is within a few per cent
    grid = (stochastic - 1.25) / 2.0**-7
    assert torch.equal(grid, grid.round())  # still bf16 values on the grid


def test_stochastic_rounding_is_refused_where_it_cannot_act() -> None:
    with pytest.raises(ConfigError, match="bf16.stochastic_rounding: it rounds the update stored in bf16 master"):
        resolve(
            _config(bf16={"enabled": True, "stochastic_rounding": True}, zero_optimization={"stage": 2}), world_size=1
        )
    with pytest.raises(ConfigError, match="is the CPU Adam op, which rounds to nearest"):
        resolve(
            _config(
                bf16={**BF16_STATES, "stochastic_rounding": True},
                zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}},
            ),
            world_size=1,
        )
    precision = resolve(
        _config(bf16={**BF16_STATES, "stochastic_rounding": True}, zero_optimization={"stage": 2}), world_size=1
    ).precision
    assert precision.master_rounding == "stochastic"
    params = [nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))]
    with pytest.raises(ValueError, match="bf16.stochastic_rounding: SGD is not Adam, AdamW or FusedAdam"):
        apply_state_dtype(torch.optim.SGD(params, lr=0.1), precision)


def test_stochastic_rounding_steps_chunks_like_one_fp32_adamw_step() -> None:
    """Pieces stepped in chunks of 100 through the scratch rows: after each of 3 steps every master is one of
    the two bf16 neighbours of the fp32 AdamW step from the same values (step count, bias correction, decay),
    and the bf16 moments are the fp32 moments rounded to nearest."""
    from slipstream.precision.masters import StochasticRounding

    generator = torch.Generator().manual_seed(3)
    masters = [torch.randn(1000, generator=generator).bfloat16(), torch.randn(250, generator=generator).bfloat16()]
    optimizer = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1)
    rounding = StochasticRounding(chunk_numel=100)
    for step in range(3):
        grads = [torch.randn(m.shape, generator=generator).bfloat16() for m in masters]
        references = []
        for master, grad in zip(masters, grads):
            exact = master.detach().float().clone()
            ref = torch.optim.AdamW([exact], lr=1e-2, weight_decay=0.1)
            if step:
                state = optimizer.state[master]
                ref.state[exact] = {
                    "step": state["step"].clone(),
                    "exp_avg": state["exp_avg"].float(),
                    "exp_avg_sq": state["exp_avg_sq"].float(),
                }
            exact.grad = grad.float()
            ref.step()
            references.append((exact, ref.state[exact]))
            master.grad = grad
        rounding.step(optimizer)
        for master, (exact, state) in zip(masters, references):
            low = exact.bfloat16().float()
            high = torch.where(
                low < exact,
                torch.nextafter(low.bfloat16(), torch.tensor(9.0).bfloat16()).float(),
                torch.nextafter(low.bfloat16(), torch.tensor(-9.0).bfloat16()).float(),
            )
            got = master.float()
            assert ((got == low) | (got == high)).all(), step
            mine = optimizer.state[master]
            assert float(mine["step"]) == step + 1
            assert torch.equal(mine["exp_avg"], state["exp_avg"].bfloat16()) and mine["exp_avg"].dtype == torch.bfloat16
            assert torch.equal(mine["exp_avg_sq"], state["exp_avg_sq"].bfloat16())


def _held_bytes(bf16: dict) -> tuple[int, int]:
    """Model-state bytes a ZeRO-2 engine holds after one step (the optimizer's tensors: parameters, masters,
    gradients, Adam moments; counted, not RSS) and what the planner predicts for the same config."""
    from slipstream.planner.estimate import settings_from_plan
    from slipstream.planner.zero_bytes import stage012_bytes

    config = _config(bf16=bf16, zero_optimization={"stage": 2})
    model = nn.Sequential(nn.Linear(96, 96), nn.Tanh(), nn.Linear(96, 40))
    numels = [p.numel() for p in model.parameters()]
    engine, *_ = slipstream.initialize(model=model, config=config)
    engine.backward(engine(torch.randn(4, 96)).float().sum())
    engine.step()
    zero = engine.optimizer
    states = sum(t.numel() * t.element_size() for s in zero.optimizer.state.values() for t in s.values()
                 if isinstance(t, torch.Tensor) and t.dim() > 0)
    roles = ("params", "master", "grads")
    held = sum(zero.owned_bytes()[r] for r in roles) + states
    settings, _ = settings_from_plan(resolve(config, world_size=1))
    owned = stage012_bytes(numels, 0, stage=2, world=1, settings=settings, offload=False).owned
    return held, sum(owned[r] for r in (*roles, "optimizer_state"))


def test_bf16_masters_and_states_hold_what_the_planner_predicts_at_zero_2() -> None:
    """bf16 params + fp32 masters + fp32 grads + fp32 Adam moments: 18 bytes a parameter on one rank; bf16
    masters (the parameters themselves), bf16 grads and bf16 moments: 8 (0.44x; 0.5x at two ranks, where the
    masters, grads and moments are halved and the parameters are not)."""
    low, low_predicted = _held_bytes(BF16_STATES)
    fp32, fp32_predicted = _held_bytes({"enabled": True})
    assert abs(low - low_predicted) <= 0.05 * low_predicted and abs(fp32 - fp32_predicted) <= 0.05 * fp32_predicted
    assert 0.4 <= low / fp32 <= 0.5, (low, fp32)

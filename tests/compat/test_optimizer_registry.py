"""The optimizer registry (config/optimizers.py) end to end, in one process: DeepSpeed's weight-decay default
on the device and the CPU-offload path, DeepSpeed 0.19's other defaults (betas, eps, Adam's adam_w_mode,
torch_adam, Lamb's and Lion's), and an optimizer added through the registry alone (Adafactor) against torch's
own class."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import slipstream
from slipstream.config.optimizers import spec_for, states_per_element
from tests.harness.models import TinyMLP

STEPS, LR = 5, 5e-2


def _engine(model: nn.Module, optimizer: dict, **zero: object) -> slipstream.SlipstreamEngine:
    config = {
        "train_batch_size": 4,
        "gradient_clipping": 0.0,
        "optimizer": optimizer,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 0, **zero},
    }
    engine, *_ = slipstream.initialize(model=model, config=config)
    return engine


def _train_engine(engine: slipstream.SlipstreamEngine, make_batch, loss_fn) -> None:
    for step in range(STEPS):
        x, y = make_batch(step)
        engine.backward(loss_fn(engine(x), y))
        engine.step()


def _train_reference(model: nn.Module, optimizer: torch.optim.Optimizer, make_batch, loss_fn) -> None:
    for step in range(STEPS):
        x, y = make_batch(step)
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    return max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize(
    "zero", [{"stage": 0}, {"stage": 1, "offload_optimizer": {"device": "cpu"}}], ids=["device", "cpu-offload"]
)
def test_adamw_without_weight_decay_trains_with_zero_decay(zero: dict) -> None:
    """DeepSpeed's AdamW defaults weight_decay to 0; torch's AdamW to 0.01. fp32, so 1e-6 separates them."""
    model = TinyMLP(seed=3)
    references = {}
    for decay in (0.0, 0.01):
        reference = copy.deepcopy(model)
        _train_reference(
            reference,
            torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=decay),
            lambda s: reference.make_batch(seed=s, batch_size=4),
            TinyMLP.loss,
        )
        references[decay] = reference
    engine = _engine(copy.deepcopy(model), {"type": "AdamW", "params": {"lr": LR}}, **zero)
    _train_engine(engine, lambda s: model.make_batch(seed=s, batch_size=4), TinyMLP.loss)
    assert _max_diff(engine.module, references[0.0]) < 2e-6
    assert _max_diff(engine.module, references[0.01]) > 2e-5  # the wrong default would be visible
    engine.destroy()


def test_torch_adam_true_keeps_torch_defaults() -> None:
    engine = _engine(TinyMLP(), {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}})
    assert engine.basic_optimizer is not None
    assert engine.basic_optimizer.param_groups[0]["weight_decay"] == 0.01  # DeepSpeed builds torch's class as is
    engine.destroy()


class Elementwise(nn.Module):
    """Only 1-D parameters of one size, so that with reduce_bucket_size equal to that size each ZeRO bucket
    is exactly one parameter and a per-tensor optimizer sees the same tensors as on the plain model."""

    size = 24

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(7)
        self.scale = nn.Parameter(torch.rand(self.size, generator=gen) + 0.5)
        self.shift = nn.Parameter(torch.randn(self.size, generator=gen) * 0.1)
        self.gain = nn.Parameter(torch.rand(self.size, generator=gen) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * self.scale + self.shift) * self.gain

    @staticmethod
    def make_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(100 + step)
        x = torch.randn(4, Elementwise.size, generator=gen)
        return x, torch.sin(x)


@pytest.mark.skipif(not hasattr(torch.optim, "Adafactor"), reason="torch.optim.Adafactor needs torch >= 2.5")
def test_adafactor_through_the_registry_matches_torch() -> None:
    spec = spec_for("Adafactor")
    assert spec is not None and not spec.elementwise and states_per_element("adafactor") == 1
    model = Elementwise()
    reference = copy.deepcopy(model)
    _train_reference(
        reference, torch.optim.Adafactor(reference.parameters(), lr=LR), Elementwise.make_batch, nn.functional.mse_loss
    )
    engine = _engine(
        copy.deepcopy(model), {"type": "adafactor", "params": {"lr": LR}}, reduce_bucket_size=Elementwise.size
    )
    _train_engine(engine, Elementwise.make_batch, nn.functional.mse_loss)
    assert _max_diff(engine.module, reference) < 1e-6
    assert _max_diff(engine.module, model) > 1e-3  # it trained
    engine.destroy()


@pytest.mark.skipif(not hasattr(torch.optim, "Adafactor"), reason="torch.optim.Adafactor needs torch >= 2.5")
def test_per_tensor_optimizer_needs_the_explicit_opt_in() -> None:
    config = {
        "train_batch_size": 4,
        "optimizer": {"type": "adafactor", "params": {"lr": LR}},
        "zero_allow_untested_optimizer": False,
    }
    with pytest.raises(ValueError, match=r"Adafactor is not known to be elementwise.*zero_allow_untested_optimizer"):
        slipstream.initialize(model=Elementwise(), config=config)


_ADAM = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}  # FusedAdam and DeepSpeedCPUAdam
_OFFLOAD = {"stage": 1, "offload_optimizer": {"device": "cpu"}}


@pytest.mark.parametrize(
    ("type_", "params", "zero", "cls", "expected"),
    [
        # DeepSpeed 0.19: "Adam" is AdamW (decoupled decay) unless adam_w_mode is false, on both paths
        ("Adam", {}, {"stage": 0}, "FusedAdam", {**_ADAM, "decoupled_weight_decay": True}),
        ("Adam", {}, _OFFLOAD, "DeepSpeedCPUAdam", {**_ADAM, "bias_correction": True, "adamw_mode": True}),
        ("Adam", {"adam_w_mode": False}, {"stage": 0}, "FusedAdam", {**_ADAM, "decoupled_weight_decay": False}),
        ("Adam", {"adam_w_mode": False}, _OFFLOAD, "DeepSpeedCPUAdam", {**_ADAM, "adamw_mode": False}),
        ("AdamW", {}, _OFFLOAD, "DeepSpeedCPUAdam", {**_ADAM, "adamw_mode": True}),
        ("Adam", {"torch_adam": True}, {"stage": 0}, "AdamW", {**_ADAM, "weight_decay": 0.01}),  # torch's own
        (
            "Lamb",
            {},
            {"stage": 0},
            "FusedLamb",
            {**_ADAM, "bias_correction": True, "eps_inside_sqrt": False, "max_coeff": 10.0, "min_coeff": 0.01},
        ),
        (  # DeepSpeed's MuonWithAuxAdam; its first param group is the Muon half of the model's matrices
            "Muon",
            {},
            {"stage": 0},
            "MuonWithAuxAdam",
            {"use_muon": True, "momentum": 0.95, "weight_decay": 0.0, "ns_method": "gram", "ns_steps": 5},
        ),
        ("Lion", {}, {"stage": 0}, "Lion", {"betas": (0.9, 0.999), "weight_decay": 0.0}),  # FusedLion
        ("Adagrad", {}, {"stage": 0}, "Adagrad", {"eps": 1e-10, "weight_decay": 0.0}),  # torch's, as DeepSpeed's
    ],
)
def test_deepspeed_optimizer_defaults(type_: str, params: dict, zero: dict, cls: str, expected: dict) -> None:
    """An optimizer section with only lr gets DeepSpeed 0.19's class and defaults (betas, eps, weight decay,
    Adam's decoupled mode) on the device and the CPU-offload path."""
    config = {
        "train_batch_size": 4,
        "optimizer": {"type": type_, "params": {"lr": LR, **params}},
        "zero_allow_untested_optimizer": True,
        "zero_optimization": zero,
    }
    engine, *_ = slipstream.initialize(model=TinyMLP(), config=config)
    optimizer = engine.basic_optimizer
    assert optimizer is not None and type(optimizer).__name__ == cls
    group = optimizer.param_groups[0]
    for key, value in expected.items():
        got = optimizer.adamw_mode if key == "adamw_mode" else group[key]  # type: ignore[attr-defined]
        assert (tuple(got) if isinstance(got, (list, tuple)) else got) == value, (key, got)
    assert group["lr"] == LR
    engine.destroy()

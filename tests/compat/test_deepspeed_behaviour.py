"""DeepSpeed behaviours client code relies on, single process.

- What `initialize()` returns as the optimizer: the basic optimizer itself at stage 0 in fp32 (the client's
  object, what its callable built, or FusedAdam for a config "Adam"), the ZeRO optimizer otherwise.
- A client optimizer or scheduler wins over the config's section, with a warning naming both.
- Argument and config errors keep our messages and are also AssertionError (DeepSpeed asserts there).
- 0/1 accepted as booleans; allgather_bucket_size alignment at stages 1-2; HJSON config files;
  `steps_per_print: inf`; Accelerate's "auto" templates (tests/fixtures/accelerate/, written for these tests
  from Accelerate's documented templates) name every unfilled key in one error, and run once filled.
"""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import slipstream
from slipstream.ops.adam import FusedAdam
from slipstream.utils import logging as slog
from tests.harness.models import TinyMLP

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "accelerate"
BASE = {"train_batch_size": 4}
ADAM = {"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}


@pytest.fixture(autouse=True)
def fresh_warnings() -> None:
    slog._WARNED.clear()


def _step(engine: Any) -> None:
    x, y = TinyMLP().make_batch(seed=0, batch_size=4)
    engine.backward(TinyMLP.loss(engine(x), y))
    engine.step()


@pytest.mark.parametrize("kind", ["config", "object", "callable"])
def test_stage0_fp32_returns_the_basic_optimizer(kind: str) -> None:
    model = TinyMLP()
    client: Any = None
    if kind == "object":
        client = torch.optim.Adam(model.parameters(), lr=1e-3)
    elif kind == "callable":
        client = lambda params: torch.optim.AdamW(params, lr=1e-3)  # noqa: E731
    config = {**BASE, **ADAM} if kind == "config" else BASE
    engine, optimizer, _, _ = slipstream.initialize(
        model=model, config=config, optimizer=client, model_parameters=list(model.parameters())
    )
    assert optimizer is engine.basic_optimizer
    if kind == "config":
        assert isinstance(optimizer, FusedAdam) and optimizer.adam_w_mode  # DeepSpeed's "Adam" is AdamW
    elif kind == "object":
        assert optimizer is client
    else:
        assert isinstance(optimizer, torch.optim.AdamW)
    _step(engine)  # the engine still steps it (through its stage-0 flat buckets)
    assert engine.global_steps == 1 and optimizer.state
    engine.destroy()


@pytest.mark.parametrize("extra", [{"zero_optimization": {"stage": 1}}, {"bf16": {"enabled": True}}])
def test_zero_or_mixed_precision_returns_the_engine_optimizer(extra: dict) -> None:
    engine, optimizer, _, _ = slipstream.initialize(model=TinyMLP(), config={**BASE, **ADAM, **extra})
    assert optimizer is engine.optimizer and optimizer is not engine.basic_optimizer
    assert isinstance(engine.basic_optimizer, FusedAdam)
    engine.destroy()


def test_client_optimizer_and_scheduler_win_over_config_sections_with_a_warning() -> None:
    model = TinyMLP()
    client = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(client, step_size=1, gamma=0.5)
    config = {**BASE, **ADAM, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, optimizer, _, returned = slipstream.initialize(
            model=model, config=config, optimizer=client, lr_scheduler=scheduler
        )
    texts = [str(w.message) for w in caught]
    assert any("SGD" in t and "'adamw'" in t and "optimizer" in t for t in texts), texts
    assert any("StepLR" in t and "'WarmupLR'" in t for t in texts), texts
    assert optimizer is client and returned is scheduler
    _step(engine)
    assert engine.get_lr() == [0.05]  # SGD at 0.1, halved by the client's StepLR
    engine.destroy()


def test_argument_errors_are_also_assertion_errors(tmp_path: Path) -> None:
    import argparse

    cases = [
        ({"config": BASE}, ValueError, "needs model="),
        ({"model": TinyMLP()}, ValueError, "no config given"),
        (
            {"model": TinyMLP(), "config": BASE, "args": argparse.Namespace(deepspeed_config=str(tmp_path / "c.json"))},
            ValueError,
            "config was given twice",
        ),
        ({"model": TinyMLP(), "config": BASE, "optimizer": "adam"}, TypeError, "torch.optim.Optimizer or a callable"),
        ({"model": TinyMLP(), "config": BASE, "optimizer": lambda params: None}, TypeError, "callable returned"),
        (
            {"model": TinyMLP(), "config": {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 3}},
            ValueError,
            "train_batch_size",
        ),  # a config problem: DeepSpeed asserts on the batch triple
    ]
    for kwargs, natural, text in cases:
        for caught in (natural, AssertionError):
            with pytest.raises(caught, match=text):
                slipstream.initialize(**kwargs)
    model = TinyMLP()
    # a scheduler object bound to another optimizer: returned as given, with a warning
    client_scheduler = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters(), lr=0.1), step_size=1)
    with pytest.warns(UserWarning, match="bound to another optimizer"):
        engine, _, _, scheduler = slipstream.initialize(
            model=model, config=BASE, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), lr_scheduler=client_scheduler
        )
    assert scheduler is client_scheduler
    engine.destroy()


def test_zero_one_are_booleans_and_allgather_alignment() -> None:
    from slipstream.config import ConfigError, resolve

    plan = resolve(
        {
            **BASE,
            "zero_allow_untested_optimizer": 1,
            "bf16": {"enabled": 1},
            "zero_optimization": {"stage": 2, "overlap_comm": 0, "allgather_bucket_size": 1000},
        },
        world_size=1,
    )
    assert plan.zero.allow_untested_optimizer is True and plan.precision.param_dtype == "bf16"
    assert plan.resolved["zero_optimization"]["overlap_comm"] is False
    for bad in (2, "true"):  # only 0 and 1: other values stay errors
        with pytest.raises(ConfigError, match="zero_allow_untested_optimizer: expected a boolean"):
            resolve({**BASE, "zero_allow_untested_optimizer": bad}, world_size=1)
    for stage in (1, 2):
        with pytest.raises(
            AssertionError,
            match="allgather_bucket_size must be a multiple of nccl_start_alignment_factor.*got 1001, use 1002",
        ):
            resolve({**BASE, "zero_optimization": {"stage": stage, "allgather_bucket_size": 1001}}, world_size=1)
    resolve({**BASE, "zero_optimization": {"stage": 3, "allgather_bucket_size": 1001}}, world_size=1)  # unchecked


def test_hjson_config_files(tmp_path: Path) -> None:
    from slipstream.config import ConfigError, load_config

    path = tmp_path / "ds.json"
    path.write_text(
        '{\n  // batch\n  "train_batch_size": 4, /* block */\n  "optimizer": {"type": "Adam", '
        '"params": {"lr": 1e-3,},},\n}\n'
    )
    assert load_config(str(path)) == {**BASE, **ADAM}
    engine, *_ = slipstream.initialize(model=TinyMLP(), config=str(path))
    _step(engine)
    engine.destroy()
    path.write_text('{\n  // comment\n  "train_batch_size": 4,\n  "train_batch_size": 8,\n}')
    with pytest.raises(ConfigError, match="train_batch_size: duplicate key in the JSON object"):
        load_config(str(path))


def test_steps_per_print_infinity_means_never(capsys: pytest.CaptureFixture[str]) -> None:
    engine, *_ = slipstream.initialize(model=TinyMLP(), config={**BASE, **ADAM, "steps_per_print": float("inf")})
    assert engine.plan.logging.steps_per_print is None
    capsys.readouterr()
    for _ in range(3):
        _step(engine)
    assert "step" not in capsys.readouterr().out.lower()
    engine.destroy()


def _filled(template: dict, *, hidden: int) -> dict:
    """Fill the template's "auto" values as Accelerate does before DeepSpeed sees the config."""
    config = copy.deepcopy(template)
    config.update(train_batch_size=4, train_micro_batch_size_per_gpu=4, gradient_clipping=1.0)
    config["fp16"]["enabled"] = False
    if "bf16" in config:
        config["bf16"]["enabled"] = True
    config["optimizer"]["params"].update(lr=1e-3, weight_decay=0.0)
    config["scheduler"]["params"].update(warmup_min_lr=0.0, warmup_max_lr=1e-3, warmup_num_steps=1, total_num_steps=5)
    zero = config["zero_optimization"]
    zero["reduce_bucket_size"] = hidden * hidden
    if zero["stage"] == 3:
        zero.update(
            stage3_prefetch_bucket_size=int(0.9 * hidden * hidden),
            stage3_param_persistence_threshold=10 * hidden,
            stage3_gather_16bit_weights_on_model_save=True,
        )
    return config


@pytest.mark.parametrize("name", ["zero_stage2_config.json", "zero_stage3_offload_config.json"])
def test_accelerate_templates(name: str) -> None:
    from slipstream.config import ConfigError, load_config, resolve

    template = load_config(str(FIXTURES / name))
    autos = [key for key, value in _leaves(template) if value == "auto"]
    with pytest.raises(ConfigError) as info:
        resolve(template, world_size=1)
    text = str(info.value)
    for key in autos:  # every unfilled "auto", each by its dotted name, in one error
        assert f"{key}:" in text or f"{key}," in text, (key, text)
    assert len(info.value.problems) == len(autos) - 1  # the two batch keys share one line
    engine, *_ = slipstream.initialize(model=TinyMLP(), config=_filled(template, hidden=37))
    _step(engine)
    assert engine.global_steps == 1 and engine.zero_optimization_stage() == template["zero_optimization"]["stage"]
    engine.destroy()


def _leaves(tree: dict, prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out += _leaves(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out


def test_templates_are_plain_json() -> None:
    for path in FIXTURES.glob("*.json"):
        assert isinstance(json.loads(path.read_text()), dict), path


def test_zero_init_wraps_tensor_constructors_through_the_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside zero.Init torch's constructors make floating tensors in Init's dtype (unless the call names one);
    the wrapper factory and `_orig_torch_*` are read from the module on entry, as Transformers expects."""
    import slipstream.zero.init as pp

    originals = {name: getattr(torch, name) for name in pp.TENSOR_CONSTRUCTORS}
    bf16 = {**BASE, "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}
    with slipstream.zero.Init(config_dict_or_path=bf16):
        assert torch.zeros(2).dtype == torch.bfloat16 and torch.randn(2).dtype == torch.bfloat16
        assert torch.arange(3).dtype == torch.int64 and torch.arange(3.0).dtype == torch.bfloat16
        assert torch.tensor([1.5]).dtype == torch.bfloat16
        assert torch.zeros(2, dtype=torch.float64).dtype == torch.float64  # a named dtype is kept
        assert pp._orig_torch_arange(3.0).dtype == torch.float32  # the escape hatch client code uses
        with slipstream.zero.Init(config_dict_or_path={**BASE, "zero_optimization": {"stage": 3}}):
            assert torch.ones(1).dtype == torch.float32  # nested (fp32) context
        assert torch.ones(1).dtype == torch.bfloat16  # the outer context's wrappers are back
        weight = torch.nn.Linear(3, 2).weight
        assert weight.dtype == torch.bfloat16
    assert {name: getattr(torch, name) for name in pp.TENSOR_CONSTRUCTORS} == originals

    seen: list[tuple[str, Any]] = []

    def factory(fn: Any, target_fp_dtype: Any, target_device: Any = None) -> Any:  # a library's replacement
        seen.append((fn.__name__, target_fp_dtype))
        return fn  # e.g. no cast at all

    monkeypatch.setattr(pp, "zero_wrapper_for_fp_tensor_constructor", factory)
    with slipstream.zero.Init(config_dict_or_path=bf16):
        assert torch.zeros(2).dtype == torch.float32
    assert sorted(name for name, _ in seen) == sorted(pp.TENSOR_CONSTRUCTORS)
    assert {dtype for _, dtype in seen} == {torch.bfloat16}
    with slipstream.zero.Init(config_dict_or_path=bf16, tensor_overrides=[]):
        assert torch.zeros(2).dtype == torch.float32 and len(seen) == len(pp.TENSOR_CONSTRUCTORS)

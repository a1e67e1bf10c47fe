"""The flops profiler, monitors (wandb, comet) and the comms logger's switch, through the engine, in one process."""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

import slipstream
from tests.harness.models import TinyMLP

MLP_FORWARD_FLOPS_PER_SAMPLE = 2 * (13 * 37 + 37 * 37 + 37 * 5)  # TinyMLP's three linear layers


@pytest.fixture
def log_lines() -> Iterator[list[str]]:
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Keep(level=logging.INFO)
    logger = logging.getLogger("slipstream")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def _train(config: dict, steps: int, gas: int = 1) -> slipstream.SlipstreamEngine:
    base = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
    }
    engine, *_ = slipstream.initialize(model=TinyMLP(), config={**base, **config})
    for step in range(steps * gas):
        x, y = TinyMLP().make_batch(seed=step, batch_size=4)
        engine.backward(TinyMLP.loss(engine(x), y))
        engine.step()
    return engine


def test_flops_profile_of_the_profiled_step_and_rates_on_the_step_line(tmp_path: Path, log_lines: list[str]) -> None:
    out = tmp_path / "profile.txt"
    engine = _train(
        {
            "steps_per_print": 1,
            "flops_profiler": {"enabled": True, "profile_step": 2, "output_file": str(out), "module_depth": 2},
        },
        steps=3,
        gas=2,
    )
    text = out.read_text()
    forward = 4 * MLP_FORWARD_FLOPS_PER_SAMPLE  # one micro-batch of 4
    assert f"Forward FLOPs:                   {forward / 1e3:.2f} KFLOPs" in text, text
    assert "Profile of step:                 2" in text and "layers.0 (Linear)" in text
    assert f"layers (ModuleList): 2.11 K params, {forward / 1e3:.2f} KFLOPs" in text  # a container sums its children
    # the training step: 2 micro-batches x (forward + backward = 3 forwards)
    assert engine._step_profiler is not None and engine._step_profiler.flops_per_step == 3 * 2 * forward
    step_lines = [line for line in log_lines if line.startswith("step ")]
    assert len(step_lines) == 3
    assert "FLOP/s per rank" not in step_lines[0] and "FLOP/s per rank" in step_lines[2]
    assert "MFU" not in step_lines[2]  # the CPU's peak is unknown
    engine.destroy()


def test_flops_profile_is_logged_when_no_file_is_given(log_lines: list[str]) -> None:
    _train({"flops_profiler": {"enabled": True, "profile_step": 1, "detailed": False}}, steps=1).destroy()
    profiles = [line for line in log_lines if line.startswith("flops profile:")]
    assert len(profiles) == 1 and "Per module" not in profiles[0]


def test_comms_summary_needs_the_comms_logger() -> None:
    engine = _train({}, steps=1)
    with pytest.raises(RuntimeError, match=r'"comms_logger": \{"enabled": true\}'):
        engine.comms_summary()
    engine.destroy()


def test_a_monitor_whose_package_is_missing_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(
        RuntimeError,
        match=r"wandb section is enabled but the wandb package is not installed; "
        r"`pip install wandb`",
    ):
        _train({"wandb": {"enabled": True}}, steps=1)
    monkeypatch.setitem(sys.modules, "comet_ml", None)
    with pytest.raises(RuntimeError, match=r"`pip install comet-ml`"):
        _train({"comet": {"enabled": True}}, steps=1)


def test_wandb_and_comet_get_the_step_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    logged: dict[str, list] = {"wandb": [], "comet": []}
    wandb = types.ModuleType("wandb")
    wandb.init = lambda **kw: logged.setdefault("init", kw)  # type: ignore[attr-defined]
    wandb.log = lambda data, step: logged["wandb"].append((step, data))  # type: ignore[attr-defined]

    class Experiment:
        def set_name(self, name: str) -> None:
            logged["name"] = name  # type: ignore[assignment]

        def log_metrics(self, data: dict, step: int) -> None:
            logged["comet"].append((step, data))

    comet = types.ModuleType("comet_ml")
    comet.start = lambda **kw: (logged.setdefault("start", kw), Experiment())[1]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setitem(sys.modules, "comet_ml", comet)
    engine = _train(
        {
            "steps_per_print": 1,
            "wandb": {"enabled": True, "project": "p", "team": "t"},
            "comet": {"enabled": True, "project": "c", "experiment_name": "run", "samples_log_interval": 8},
        },
        steps=4,
    )
    assert logged["init"] == {"project": "p", "group": None, "entity": "t"}
    assert logged["start"] == {"project": "c"} and logged["name"] == "run"
    assert [step for step, _ in logged["wandb"]] == [4, 8, 12, 16]
    assert [step for step, _ in logged["comet"]] == [4, 12]  # every 8 samples at most
    last = logged["wandb"][-1][1]
    assert last["Train/Samples/train_loss"] == pytest.approx(engine.last_loss) and "Train/Samples/lr" in last
    engine.destroy()


def test_csv_monitor_writes_every_optimizer_step_without_steps_per_print(tmp_path: Path, log_lines: list[str]) -> None:
    """DeepSpeed writes its monitor events at every optimizer step whatever `steps_per_print` is (unset here, its
    default): one row per step for each event, at the global sample count after the step; no progress line and
    no print-window figures."""
    engine = _train(
        {"fp16": {"enabled": True}, "csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "r"}},
        steps=3,
        gas=2,
    )
    rows = {
        name: (tmp_path / "r" / f"Train_Samples_{name}.csv").read_text().splitlines()
        for name in ("train_loss", "lr", "loss_scale")
    }
    for name, lines in rows.items():
        assert lines[0] == "step,value", name
        assert [line.split(",")[0] for line in lines[1:]] == ["8", "16", "24"], name
    assert float(rows["lr"][-1].split(",")[1]) == pytest.approx(1e-2)
    assert float(rows["train_loss"][-1].split(",")[1]) == pytest.approx(engine.last_loss)
    assert float(rows["loss_scale"][-1].split(",")[1]) == engine.loss_scaler.scale  # type: ignore[union-attr]
    assert not (tmp_path / "r" / "Train_Samples_samples_per_sec.csv").exists()
    assert not [line for line in log_lines if line.startswith("step ")]
    engine.destroy()

"""The engine's side of a trial (autotuning/trial.py): a run with `autotuning.enabled` times the profiled steps,
writes the metrics file and ends; the profile request gets the planner's figures of every candidate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import slipstream
from slipstream.autotuning.estimates import estimate_config, read_answer, read_profile
from slipstream.autotuning.trial import PROFILE_ENV, TrialRecorder
from tests.harness.models import TinyMLP

CONFIG = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def _train_until_exit(config: dict, steps: int = 20) -> int:
    """Optimizer steps taken before the engine ended the run (SystemExit 0)."""
    model = TinyMLP()
    engine, *_ = slipstream.initialize(model=model, config=config)
    with pytest.raises(SystemExit) as ended:
        for seed in range(steps):
            inputs, targets = model.make_batch(seed=seed, batch_size=4)
            engine.backward(TinyMLP.loss(engine(inputs), targets))
            engine.step()
    taken = engine.global_steps
    engine.destroy()
    assert ended.value.code == 0
    return taken


def test_a_profiled_run_writes_its_metrics_and_ends_after_the_last_profiled_step(tmp_path: Path) -> None:
    path = tmp_path / "metrics.json"
    tuning = {"enabled": True, "metric_path": str(path), "start_profile_step": 2, "end_profile_step": 5}
    assert _train_until_exit({**CONFIG, "autotuning": tuning}) == 5
    metrics = json.loads(path.read_text())
    assert metrics["steps"] == 3 and metrics["train_batch_size"] == 4
    assert metrics["throughput"] == pytest.approx(4 / metrics["latency"])


def test_one_stalled_step_does_not_set_the_latency(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([0.0, 1.0, 2.0, 12.0, 13.0, 14.0])  # the ends of steps 1 (start) .. 6: step 4 stalled for 10 s
    monkeypatch.setattr(TrialRecorder, "_now", staticmethod(lambda: next(clock)))
    path = tmp_path / "metrics.json"
    tuning = {"enabled": True, "metric_path": str(path), "start_profile_step": 1, "end_profile_step": 6}
    assert _train_until_exit({**CONFIG, "autotuning": tuning}) == 6
    metrics = json.loads(path.read_text())
    assert (metrics["steps"], metrics["latency"], metrics["mean_latency"]) == (5, 1.0, 14.0 / 5)
    assert metrics["throughput"] == 4.0


def test_without_the_section_nothing_is_recorded(tmp_path: Path) -> None:
    model = TinyMLP()
    engine, *_ = slipstream.initialize(model=model, config=CONFIG)
    assert not any(type(o).__name__ == "TrialRecorder" for o in engine._step_observers)
    engine.destroy()


class _Named:
    """What read_answer asks of a candidate: its name, micro batch and checkpointing."""

    def __init__(self, name: str) -> None:
        self.name, self.micro_batch, self.activation_checkpointing = name, 4, None


def test_the_profile_request_gets_the_planners_figures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    other = {**CONFIG, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    answer = tmp_path / "answer.json"
    request = {"candidates": {"plain": CONFIG, "offload": other}, "profiled": "plain", "answer": str(answer)}
    (tmp_path / "request.json").write_text(json.dumps(request))
    monkeypatch.setenv(PROFILE_ENV, str(tmp_path / "request.json"))
    assert _train_until_exit(CONFIG) == 2  # step 1 counted, step 2 timed
    figures = read_answer(answer, [_Named("plain"), _Named("offload")])  # type: ignore[list-item]
    for name, config in request["candidates"].items():
        device, host = estimate_config(config, module=TinyMLP(), world_size=1, gpus_per_node=1)
        assert (figures[name].device, figures[name].host) == (device, host)
    assert figures["offload"].host > 0 and figures["plain"].host == 0
    assert figures["plain"].activations is None  # the CPU's RSS says nothing of activations
    _check_profile(answer)


def _check_profile(answer: Path) -> None:
    """The profile: the flops profiler's FLOPs per sample of TinyMLP's step, and the forward timed per layer."""
    profile = read_profile(answer)
    assert profile is not None
    sizes = [(layer.in_features, layer.out_features) for layer in TinyMLP().layers]
    forward = sum(2 * a * b for a, b in sizes)
    # the backward: each weight's gradient (a forward's FLOPs) and the inputs' gradients past the first layer
    backward = forward + sum(2 * a * b for a, b in sizes[1:])
    assert profile.flops_per_sample == forward + backward
    assert set(profile.block_forward_s) == {"layers.0", "layers.1", "layers.2", "(rest)"}
    assert all(seconds >= 0 for seconds in profile.block_forward_s.values())
    assert profile.block_forward_s["layers.0"] > 0 and profile.step_s > profile.forward_s
    assert (profile.micro_batch, profile.grad_accum) == (4, 1)
    assert profile.numel == sum(p.numel() for p in TinyMLP().parameters()) and profile.param_bytes == 4

"""`ThroughputTimer` (DeepSpeed's engine.tput_timer): counts, the warm-up, the timed spans and the average, with a
fake clock; and the engine starting it at every forward and stopping it at every step()."""

from __future__ import annotations

import pytest

from slipstream.utils import throughput
from slipstream.utils.throughput import ThroughputTimer


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def time(self) -> float:
        return self.now


def test_counts_warm_up_and_average(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setattr(throughput, "time", clock)
    timer = ThroughputTimer(batch_size=12, start_step=2)
    timer.stop()  # before any start: no effect
    assert (timer.initialized, timer.micro_step_count) == (False, 0)
    assert timer.avg_samples_per_sec() == float("-inf")
    for step in range(5):  # 2 micro-batches per optimizer step, each 0.5 s from start to stop, 1 s outside
        for micro in range(2):
            timer.start()
            clock.now += 0.5
            timer.stop(global_step=micro == 1)
            clock.now += 1.0
        assert timer.global_step_count == step + 1 and timer.micro_step_count == 2 * (step + 1)
        if step < 2:  # warm-up steps are not timed
            assert timer.total_elapsed_time == 0 and timer.start_time == 0
    assert timer.step_elapsed_time == 0  # reset at each optimizer step
    assert timer.total_elapsed_time == pytest.approx(3.0)  # steps 3..5, 1 s of spans each
    assert timer.avg_samples_per_sec() == pytest.approx(12.0)


def test_the_engine_drives_it() -> None:
    import slipstream
    from tests.harness.models import TinyMLP

    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine, *_ = slipstream.initialize(model=TinyMLP(), config=config)
    timer = engine.tput_timer
    assert timer.batch_size == 8 and not timer.initialized
    for micro in range(8):
        x, y = TinyMLP().make_batch(seed=micro, batch_size=4)
        engine.backward(TinyMLP.loss(engine(x), y))
        engine.step()
    assert (timer.micro_step_count, timer.global_step_count) == (8, 4) and engine.global_steps == 4
    assert timer.total_elapsed_time > 0 and 0 < timer.avg_samples_per_sec() < float("inf")


def test_disabled_timer_stays_at_zero_and_synchronize_precedes_each_reading() -> None:
    calls: list[int] = []
    timer = ThroughputTimer(batch_size=4, start_step=0, synchronize=lambda: calls.append(1))
    timer.start()
    timer.stop(global_step=True)
    assert len(calls) == 2 and timer.global_step_count == 1  # start and stop each read the clock
    off = ThroughputTimer(batch_size=4, enabled=False)
    off.start()
    off.stop(global_step=True)
    assert (off.initialized, off.micro_step_count, off.global_step_count) == (False, 0, 0)


def test_the_config_keys_reach_the_engine() -> None:
    import slipstream
    from tests.harness.models import TinyMLP

    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
              "timers": {"throughput": {"enabled": False, "synchronized": False}}}
    engine, *_ = slipstream.initialize(model=TinyMLP(), config=config)
    assert engine.tput_timer.synchronize is None
    x, y = TinyMLP().make_batch(seed=0, batch_size=4)
    engine.backward(TinyMLP.loss(engine(x), y))
    engine.step()
    assert engine.global_steps == 1 and engine.tput_timer.global_step_count == 0

"""`slipstream nvme tune` (DeepSpeed's ds_nvme_tune): the sweep, its decision, and the aio section it writes.

The decision is tested on a simulated drive (`_simulated_drive`): the fallback moves the bytes, then a sleep
per transfer that depends on the settings, so which settings is fastest is known and large (4x) against the
machine's noise; and on one where every settings is equally fast, where the tuner must keep the defaults.
The CLI test runs whichever async_io loads here on small files in tmp_path.
"""

from __future__ import annotations

import dataclasses
import json
import time
import types
from pathlib import Path

import pytest

import slipstream.ops.fallback.async_io as fallback_op
from slipstream.cli.main import main as cli_main
from slipstream.config import resolve
from slipstream.config.plan import AioPlan
from slipstream.config.zero_plans import default_aio_plan
from slipstream.ops.aio.bench import AioSettings, IoBench
from slipstream.ops.aio.tune import decide, grid, sign_test_p, tune

DEFAULTS = default_aio_plan()
FAST = dataclasses.replace(DEFAULTS, block_size=4 << 20, queue_depth=16)


def _json_of(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict:
    assert cli_main(argv) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(("argv", "message"), [
    (["nvme", "tune", "{missing}"], "{missing} does not exist; give an existing directory"),
    (["nvme", "tune", "{dir}", "--budget-s", "0"], "--budget-s 0.0: expected seconds > 0"),
])
def test_bad_paths_and_budgets_are_named(argv: list[str], message: str, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    names = {"missing": str(tmp_path / "nope"), "dir": str(tmp_path)}
    assert cli_main([arg.format(**names) for arg in argv]) == 2
    assert message.format(**names) in capsys.readouterr().err


def _simulated_drive(seconds_for: dict[AioSettings, float], default_s: float) -> types.SimpleNamespace:
    """An async_io module: the fallback moves the bytes, then wait() sleeps as long as the settings' speed says."""

    class Handle(fallback_op.aio_handle):
        def wait(self) -> int:
            done = super().wait()
            settings = AioPlan(block_size=self.get_block_size(), queue_depth=self.get_queue_depth(),
                               intra_op_parallelism=self.get_intra_op_parallelism(),
                               single_submit=self.get_single_submit(), overlap_events=self.get_overlap_events())
            time.sleep(seconds_for.get(settings, default_s) * done)
            return done

    return types.SimpleNamespace(aio_handle=Handle)


def _candidates() -> list[AioSettings]:
    return grid(DEFAULTS, block_sizes=[1 << 20, 4 << 20], queue_depths=[8, 16], parallelisms=[1],
                overlap_events=[True])


def test_tuner_finds_the_fastest_settings_and_says_it_beats_the_defaults(tmp_path: Path) -> None:
    bench = IoBench(tmp_path, module=_simulated_drive({FAST: 0.002}, default_s=0.008))
    report = tune(bench, DEFAULTS, _candidates(), 1 << 16, budget_s=1.0)
    bench.close()
    assert len(report.candidates) == 4 and report.candidates[0].settings == FAST
    verdict = report.verdict
    assert verdict.tuned_beats_defaults and verdict.recommended == FAST, verdict.text
    assert verdict.pairs >= 8 and verdict.median_gain > 1.0  # 4x in the simulation: +300%
    assert verdict.text.startswith("the tuned settings beat the defaults: faster in ")


def test_tuner_keeps_the_defaults_when_nothing_is_faster(tmp_path: Path) -> None:
    bench = IoBench(tmp_path, module=_simulated_drive({}, default_s=0.006))
    report = tune(bench, DEFAULTS, _candidates(), 1 << 16, budget_s=1.0)
    bench.close()
    assert not report.verdict.tuned_beats_defaults and report.verdict.recommended == DEFAULTS, report.verdict.text
    assert report.verdict.text.startswith("the defaults are already best")


def test_a_small_budget_measures_the_defaults_and_leaves_the_rest_unmeasured(tmp_path: Path) -> None:
    ticks = iter(range(1000))  # a clock that advances 1 s per reading: the budget runs out at once
    bench = IoBench(tmp_path, module=fallback_op)
    report = tune(bench, DEFAULTS, _candidates(), 1 << 16, budget_s=2.0, clock=lambda: float(next(ticks)))
    bench.close()
    measured = [c.settings for c in report.candidates if c.write_s]
    assert measured == [DEFAULTS] and report.rounds == 1
    assert report.verdict.recommended == DEFAULTS and not report.verdict.tuned_beats_defaults


def test_decision_rule_needs_consistency_and_size() -> None:
    assert sign_test_p(8, 8) == pytest.approx(1 / 256) and sign_test_p(0, 5) == 1.0
    clear = [(1.0, 0.8)] * 10
    assert decide(DEFAULTS, FAST, clear).tuned_beats_defaults
    slight = [(1.0, 0.98)] * 10  # always faster, but by 2%: below MIN_GAIN
    assert not decide(DEFAULTS, FAST, slight).tuned_beats_defaults
    mixed = [(1.0, 0.7), (1.0, 1.3)] * 5  # large but inconsistent
    assert not decide(DEFAULTS, FAST, mixed).tuned_beats_defaults
    assert decide(DEFAULTS, DEFAULTS, []).recommended == DEFAULTS


def test_nvme_tune_on_this_machine_writes_an_aio_section_the_config_accepts(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    drive, output = tmp_path / "drive", tmp_path / "aio.json"
    drive.mkdir()
    data = _json_of(capsys, ["nvme", "tune", str(drive), "--budget-s", "2", "--size", "1M", "--block-sizes",
                             "256K,1M", "--queue-depths", "4,8", "--parallelisms", "1", "--output", str(output),
                             "--json"])
    # the native op sweeps overlap_events too (no effect in the fallback): 2 block sizes x 2 depths (x 2)
    assert data["measured"] >= 1 and len(data["candidates"]) == (4 if data["kind"] == "fallback" else 8)
    assert [row["is_defaults"] for row in data["candidates"]].count(True) == 1
    assert data["verdict"].startswith("the tuned settings beat" if data["tuned_beats_defaults"] else
                                      "the defaults are already best")
    assert (data["recommended"] == data["defaults"]) != data["tuned_beats_defaults"]
    if data["kind"] == "fallback":
        assert [row["overlap_events"] for row in data["candidates"]] == [True] * 4  # no effect there: not swept
    assert data["spent_s"] < data["budget_s"] + 10  # at least 8 confirmation pairs of 1 MiB cycles may follow
    section = json.loads(output.read_text())
    assert section == {"aio": data["recommended"]}
    plan = resolve({"train_batch_size": 1, "zero_optimization": {"stage": 2, "offload_optimizer": {
        "device": "nvme", "nvme_path": str(drive)}}, **section}, world_size=1)
    assert dataclasses.asdict(plan.zero.offload_optimizer.aio) == data["recommended"]  # type: ignore[attr-defined]
    assert list(drive.iterdir()) == []
    assert cli_main(["nvme", "tune", str(drive), "--budget-s", "1", "--size", "256K", "--block-sizes", "1M",
                     "--queue-depths", "8", "--parallelisms", "1"]) == 0
    table = capsys.readouterr().out
    swept = 1 if data["kind"] == "fallback" else 2  # the native op also tries overlap_events false
    assert f"of {swept} settings measured" in table and "<- defaults" in table
    if swept == 1:
        assert "the defaults are already best: no other settings was faster in the sweep" in table
    else:
        assert "the defaults are already best" in table or "the tuned settings beat" in table

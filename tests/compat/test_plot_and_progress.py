"""`slipstream plot` draws a run's csv monitor files; progress is a bar in a terminal and quarter lines elsewhere."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

import slipstream
from slipstream.cli.main import main as cli_main
from slipstream.utils.progress import Progress
from tests.harness.models import TinyMLP


def test_a_trained_run_is_plotted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "steps_per_print": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
        "csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "run1"},
    }
    engine, *_ = slipstream.initialize(model=TinyMLP(), config=config)
    for step in range(8):
        x, y = TinyMLP().make_batch(seed=step, batch_size=4)
        engine.backward(TinyMLP.loss(engine(x), y))
        engine.step()
    engine.destroy()
    run_dir = tmp_path / "run1"
    rows = (run_dir / "Train_Samples_samples_per_sec.csv").read_text().splitlines()
    assert rows[0] == "step,value" and len(rows) == 9 and rows[-1].startswith("32,")
    assert float((run_dir / "Train_Samples_memory_bytes.csv").read_text().splitlines()[-1].split(",")[1]) > 1e6
    assert cli_main(["plot", str(run_dir)]) == 0
    assert "loss, learning rate, gradient norm (before clipping), samples/s, memory" in capsys.readouterr().out
    png = (run_dir / "run.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    assert cli_main(["plot", str(tmp_path)]) == 1  # the parent directory holds no csv files: named
    assert "holds none of the csv monitor's files" in capsys.readouterr().out


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_writes_quarter_lines_to_a_file_and_a_bar_to_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    logged = io.StringIO()
    bar = Progress("export", 400, unit="MB", stream=logged)
    for _ in range(8):
        bar.advance(50)
    bar.finish()
    assert [line.split(" ", 2)[:2] for line in logged.getvalue().splitlines()] == [
        ["export:", "25%"],
        ["export:", "50%"],
        ["export:", "75%"],
        ["export:", "100%"],
    ]
    monkeypatch.setitem(__import__("sys").modules, "tqdm", None)  # the built-in bar, without tqdm
    screen = _Terminal()
    bar = Progress("load", 200, unit="MB", stream=screen)
    bar.advance(100, "layer.0")
    bar.finish()
    assert screen.getvalue().startswith("\rload [###############...............]  50.0% 100/200 MB")
    quiet = io.StringIO()
    Progress("x", 10, stream=quiet, enabled=False).advance(10)
    assert quiet.getvalue() == ""

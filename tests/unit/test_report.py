"""`slipstream report`: the op table and the environment, as text and JSON, from the CLI and -m."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from slipstream import report
from slipstream.cli.main import main as cli_main


def test_json_report_has_every_op_and_the_versions(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["report", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    import torch

    rows = {row["name"]: row for row in data["ops"]}
    assert set(rows) == {"cpu_adam", "cpu_lamb", "async_io"}
    assert rows["async_io"]["build_var"] == "DS_BUILD_AIO"
    assert rows["cpu_adam"]["build_var"] == "DS_BUILD_CPU_ADAM"
    assert isinstance(rows["cpu_adam"]["installed"], bool)
    assert rows["cpu_adam"]["loads_as"].split()[0] in {"prebuilt", "jit", "fallback"}
    env = data["environment"]
    assert env["torch_version"] == torch.__version__
    assert env["accelerator"] == "cpu"
    assert env["python_version"].count(".") == 2
    assert env["cpu_simd"] in {"avx512", "avx2", "neon", "scalar"}


def test_text_report_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLIPSTREAM_OPS", "fallback")
    from slipstream.ops.op_builder import builder

    monkeypatch.setattr(builder, "_LOADED", {})
    text = report.format_report(report.collect())
    assert "cpu_adam" in text and "fallback (SLIPSTREAM_OPS=fallback)" in text
    assert "torch version" in text and "shared memory (/dev/shm) size" in text


def test_incompatible_op_shows_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    from slipstream.ops.op_builder import builder

    monkeypatch.setattr(builder, "_LOADED", {})
    monkeypatch.setattr("slipstream.git_version_info.installed_ops", {})
    text = report.format_report(report.collect())
    assert "[NO]" in text and "reason: no C++ compiler" in text


def test_python_dash_m_and_console_forms() -> None:
    out = subprocess.run([sys.executable, "-m", "slipstream.report", "--json"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert json.loads(out)["ops"][0]["name"] == "cpu_adam"
    out = subprocess.run([sys.executable, "-m", "slipstream.cli.main", "report"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert "Slipstream native op report" in out

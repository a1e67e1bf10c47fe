"""The in-tree build backend and the build metadata a source checkout reports."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def load_backend():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("build_backend_under_test", REPO / "tools" / "build_backend.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("env", "platform", "expected"),
    [
        ({}, "linux", False),
        ({"DS_BUILD_OPS": "1"}, "linux", True),
        ({"DS_BUILD_CPU_ADAM": "1"}, "linux", True),
        ({"DS_BUILD_CPU_ADAM": "0", "DS_BUILD_STRING": ".dev1"}, "linux", False),
        ({}, "win32", True),  # DeepSpeed builds every op by default on Windows
        ({"DS_BUILD_OPS": "0"}, "win32", False),
    ],
)
def test_aot_requested(env: dict[str, str], platform: str, expected: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = load_backend()
    monkeypatch.setattr(sys, "platform", platform)
    assert backend.aot_requested(env) is expected


def test_aot_adds_the_target_torch_version(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    backend = load_backend()
    (tmp_path / "torch-2.13.0+cpu.dist-info").mkdir()
    monkeypatch.setattr(backend.sysconfig, "get_paths", lambda: {"purelib": str(tmp_path), "platlib": str(tmp_path)})
    monkeypatch.setenv("DS_BUILD_CPU_ADAM", "1")
    monkeypatch.setenv("DS_ENABLE_NINJA", "1")
    assert backend._extra_requires() == ["torch==2.13.0+cpu", "ninja"]
    monkeypatch.setenv("DS_BUILD_CPU_ADAM", "0")
    monkeypatch.delenv("DS_BUILD_OPS", raising=False)
    monkeypatch.setattr(sys, "platform", "linux")
    assert backend._extra_requires() == []


def test_source_checkout_without_build_info_reports_jit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "slipstream.git_version_info_installed", None)  # import fails
    import slipstream.git_version_info as info

    fresh = importlib.reload(info)
    try:
        assert fresh.mode == "jit"
        assert fresh.installed_ops == {}
        assert fresh.version == (REPO / "version.txt").read_text().strip()
    finally:
        monkeypatch.undo()
        importlib.reload(info)

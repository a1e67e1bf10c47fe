"""`ruff check` and `ruff format --check` over the package (rules and version in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _ruff(*args: str) -> subprocess.CompletedProcess[str]:
    if subprocess.run([sys.executable, "-m", "ruff", "--version"], capture_output=True).returncode != 0:
        pytest.skip("ruff is not installed; `pip install -e .[dev]` brings it")
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)


def test_ruff_check_is_clean() -> None:
    result = _ruff("check", "slipstream")
    assert result.returncode == 0, result.stdout[-5000:]


def test_ruff_format_is_clean() -> None:
    result = _ruff("format", "--check", "slipstream")
    assert result.returncode == 0, f"run `ruff format slipstream`:\n{result.stdout[-5000:]}"

"""mypy over the package (docs/design.md, layer rules): the annotations stay true as the code changes."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_mypy_finds_no_errors() -> None:
    if shutil.which("mypy") is None and subprocess.run([sys.executable, "-m", "mypy", "--version"],
                                                       capture_output=True).returncode != 0:
        pytest.skip("mypy is not installed; `pip install -e .[dev]` brings it")
    result = subprocess.run([sys.executable, "-m", "mypy", "slipstream"], cwd=REPO, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-5000:]

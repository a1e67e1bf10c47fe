"""House rules a machine can check: module size, no shell strings, no bare `assert False`, ASCII only."""

from __future__ import annotations

import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "slipstream"
SOURCES = sorted(PACKAGE.rglob("*.py"))
HARD_CAP_LINES = 600


def test_there_are_sources() -> None:
    assert len(SOURCES) > 10


def test_modules_stay_under_the_hard_cap() -> None:
    big = {str(p.relative_to(PACKAGE)): n for p in SOURCES if (n := len(p.read_text().splitlines())) > HARD_CAP_LINES}
    assert not big, f"modules over {HARD_CAP_LINES} lines (split them by mechanism): {big}"


def test_no_shell_strings() -> None:
    pattern = re.compile(r"shell\s*=\s*True|os\.system\(|os\.popen\(")
    hits = [f"{p.relative_to(PACKAGE)}:{i}" for p in SOURCES for i, line in enumerate(p.read_text().splitlines(), 1)
            if pattern.search(line)]
    assert not hits, f"shell strings are forbidden (build argv lists): {hits}"


def test_no_bare_assert_false() -> None:
    pattern = re.compile(r"^\s*assert\s+(False|0)\b")
    hits = [f"{p.relative_to(PACKAGE)}:{i}" for p in SOURCES for i, line in enumerate(p.read_text().splitlines(), 1)
            if pattern.search(line)]
    assert not hits, f"raise an error that names the problem instead: {hits}"


def test_ascii_only() -> None:
    bad = [str(p.relative_to(PACKAGE)) for p in [*SOURCES, *PACKAGE.rglob("*.cpp"), *PACKAGE.rglob("*.h")]
           if not p.read_bytes().isascii()]
    assert not bad, f"non-ASCII characters in {bad}"

"""docs/architecture.md names every folder of the package: each folder under slipstream/ holding source files,
and each module at the package's top, has its own line in the Layout block (a new folder without one fails
here, named), and every folder named there exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "slipstream"
DOC = ROOT / "docs" / "architecture.md"
SOURCES = {".py", ".cpp", ".h", ".cu", ".cuh"}
GENERATED = {"git_version_info_installed.py"}
"""Written by a build (setup.py), ignored by git: a checkout may or may not have it."""


def _package_lines() -> list[str]:
    """The lines of the Layout block under `slipstream/`, up to the next unindented line."""
    text = DOC.read_text()
    layout = text[text.index("## Layout") :]
    block = layout[layout.index("```") + 3 :]
    block = block[: block.index("```")]
    lines = block.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("slipstream/"))
    body = []
    for line in lines[start + 1 :]:
        if line and not line[0].isspace():
            break
        body.append(line)
    return body


def _named(lines: list[str]) -> set[str]:
    """The path each line starts with (`zero/stage3/`, `api.py`); comment-only continuation lines name nothing."""
    first = (re.match(r"\s+([\w./]+)\s", line + " ") for line in lines)
    return {match.group(1) for match in first if match is not None}


def _folders() -> list[str]:
    folders = []
    for folder in sorted(p for p in PACKAGE.rglob("*") if p.is_dir()):
        parts = folder.relative_to(PACKAGE).parts
        if any(part.startswith((".", "__")) for part in parts):
            continue
        if any(child.suffix in SOURCES for child in folder.iterdir() if child.is_file()):
            folders.append("/".join(parts) + "/")
    return folders


def test_every_package_folder_and_top_module_has_its_line() -> None:
    named = _named(_package_lines())
    missing = [folder for folder in _folders() if folder not in named]
    missing += [
        module.name
        for module in sorted(PACKAGE.glob("*.py"))
        if module.name not in named and module.name not in GENERATED
    ]
    assert not missing, (
        f"docs/architecture.md's Layout has no line for {missing}: add one per folder (`  {missing[0]:<24}# what "
        "it holds`), in the project's words"
    )


def test_every_folder_named_exists() -> None:
    stale = sorted(path for path in _named(_package_lines()) if not (PACKAGE / path).exists())
    assert not stale, f"docs/architecture.md's Layout names {stale}, which slipstream/ does not have: update the map"

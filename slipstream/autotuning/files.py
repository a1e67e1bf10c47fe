"""The tuner's JSON files (requests, answers, metrics, configs), written whole or not at all, and the variable
that marks the profile run (light to import: the session and the tuner import no torch)."""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["PROFILE_ENV", "read_json", "write_json"]

PROFILE_ENV = "SLIPSTREAM_AUTOTUNING_PROFILE"
"""Set by the tuner on its profile run: the path of the request (candidates' configs, where to write)."""


def write_json(path: str | Path, data: object) -> None:
    """Write `data` as JSON at `path` through a temporary file and a rename (a reader never sees half of it)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    partial.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(partial, target)


def read_json(path: str | Path) -> object:
    """The JSON value in the file at `path`."""
    return json.loads(Path(path).read_text())

"""The tuner's JSON files (requests, answers, metrics, configs), written whole or not at all."""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["write_json"]


def write_json(path: str | Path, data: object) -> None:
    """Write `data` as JSON at `path` through a temporary file and a rename (a reader never sees half of it)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    partial.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(partial, target)

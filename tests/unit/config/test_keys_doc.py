"""docs/config-keys.md is the schema's table of keys, defaults and status, regenerated, not hand-edited."""

from __future__ import annotations

from pathlib import Path

from slipstream.config.keys_doc import render

DOC = Path(__file__).resolve().parents[3] / "docs" / "config-keys.md"


def test_the_key_table_is_current() -> None:
    assert DOC.read_text() == render(), "regenerate: python -m slipstream.config.keys_doc > docs/config-keys.md"


def test_the_table_tells_honoured_from_reported() -> None:
    text = render()
    assert "| `zero_optimization.stage` | `0` | honoured: `zero.stage` |" in text
    assert "| `amp.opt_level` | `null` | reported |" in text

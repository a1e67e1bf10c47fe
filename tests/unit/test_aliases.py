"""DeepSpeed module paths declared in compat/aliases.py: the same module object, and `python -m` runs it."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from slipstream.compat.aliases import ALIASES


@pytest.mark.parametrize("alias, target", sorted(ALIASES.items()))
def test_an_alias_is_the_target_module(alias: str, target: str) -> None:
    module = importlib.import_module(alias)
    assert module is importlib.import_module(target)
    assert module.__spec__ is not None and module.__spec__.name == target  # the target keeps its own spec


def test_python_dash_m_runs_an_alias() -> None:
    result = subprocess.run([sys.executable, "-m", "slipstream.utils.zero_to_fp32", "--help"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and "usage: python -m slipstream.utils.zero_to_fp32" in result.stdout


def test_unknown_names_are_not_aliased() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("slipstream.utils.no_such_module")

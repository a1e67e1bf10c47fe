"""Native ops: builders (`op_builder/`), C++ sources (`csrc/`), pure-PyTorch fallbacks and Python faces (`adam/`).

Importing this package compiles nothing; an op is built or loaded on first use.
`__compatible_ops__` (DeepSpeed's op name -> whether it can run here) is declared in compat/aliases.py.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    import importlib

    return importlib.import_module("slipstream.compat.aliases").composite_attribute(__name__, name)

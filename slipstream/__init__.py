"""Slipstream: ZeRO training on PyTorch with DeepSpeed's API and JSON config.

`import slipstream` is cheap and silent: it does not even import torch, compiles nothing and
touches no device. Subpackages load on first attribute access.
"""

from __future__ import annotations

import importlib
from typing import Any

from slipstream.git_version_info import git_branch as __git_branch__
from slipstream.git_version_info import git_hash as __git_hash__
from slipstream.git_version_info import version as __version__

_LAZY_SUBMODULES = ("accelerator", "ops", "cli")

__all__ = ["__version__", "__git_hash__", "__git_branch__", "get_accelerator", *_LAZY_SUBMODULES]


def __getattr__(name: str) -> Any:
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"slipstream.{name}")
    if name == "get_accelerator":
        from slipstream.accelerator import get_accelerator

        return get_accelerator
    raise AttributeError(f"module 'slipstream' has no attribute {name!r}")

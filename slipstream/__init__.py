"""Slipstream: ZeRO training on PyTorch with DeepSpeed's API and JSON config.

`import slipstream` is cheap and silent: it does not even import torch, compiles nothing and
touches no device. Subpackages load on first attribute access.
"""

from __future__ import annotations

import importlib
from typing import Any

from slipstream.compat.aliases import install as _install_aliases
from slipstream.git_version_info import git_branch as __git_branch__
from slipstream.git_version_info import git_hash as __git_hash__
from slipstream.git_version_info import version as __version__

_LAZY_SUBMODULES = (
    "accelerator",
    "ops",
    "cli",
    "comm",
    "config",
    "zero",
    "engine",
    "planner",
    "checkpoint",
    "parallel",
    "sequence",
    "checkpointing",
    "compression",
    "pipe",
    "profiling",
    "moe",
)
_LAZY_ATTRIBUTES = {
    "initialize": "slipstream.api",
    "init_distributed": "slipstream.api",
    "add_config_arguments": "slipstream.api",
    "tp_model_init": "slipstream.api",
    "init_inference": "slipstream.inference",
    "get_accelerator": "slipstream.accelerator",
    "SlipstreamEngine": "slipstream.engine.engine",
    "DeepSpeedEngine": "slipstream.engine.engine",
    "ConfigError": "slipstream.config",
    "DeepSpeedConfigError": "slipstream.config.errors",
    "DeepSpeedConfig": "slipstream.compat.ds_config",
    "DeepSpeedOptimizer": "slipstream.zero.optimizer",
    "add_tuning_arguments": "slipstream.compat.lr_names",
    "logger": "slipstream.compat.runtime_utils",
    "log_dist": "slipstream.compat.runtime_utils",
    "OnDevice": "slipstream.compat.runtime_utils",
    "PipelineModule": "slipstream.pipe.module",
    "PipelineEngine": "slipstream.pipe.engine",
}
_RENAMED = {
    "DeepSpeedEngine": "SlipstreamEngine",
    "DeepSpeedConfigError": "ConfigError",
    "DeepSpeedOptimizer": "ZeroOptimizer",
}
"""DeepSpeed's name -> ours, for the lazy attributes above."""

_install_aliases()  # DeepSpeed's module paths (compat/aliases.py)


def _version_part(index: int) -> int:
    part = (__version__.split("+")[0].split(".") + ["0", "0", "0"])[index]
    return int("".join(c for c in part if c.isdigit()) or 0)


__version_major__, __version_minor__, __version_patch__ = _version_part(0), _version_part(1), _version_part(2)
"""Slipstream's own version, split as DeepSpeed splits its; the `deepspeed` compatibility package reports
DeepSpeed's API level instead (compat/deepspeed_dist.py)."""

__all__ = [
    "__version__",
    "__version_major__",
    "__version_minor__",
    "__version_patch__",
    "__git_hash__",
    "__git_branch__",
    *_LAZY_ATTRIBUTES,
    *_LAZY_SUBMODULES,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY_SUBMODULES:
        return importlib.import_module(f"slipstream.{name}")
    if name in _LAZY_ATTRIBUTES:
        module = importlib.import_module(_LAZY_ATTRIBUTES[name])
        return getattr(module, _RENAMED.get(name, name))
    from slipstream.compat.aliases import declared_child

    child = declared_child("slipstream", name)  # DeepSpeed's paths such as `deepspeed.runtime`, as attributes
    if child is not None:
        return child
    raise AttributeError(f"module 'slipstream' has no attribute {name!r}")

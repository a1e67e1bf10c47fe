"""The deprecation policy's one helper (docs/support.md): a deprecated name keeps working for at least one
minor release after the one that deprecates it, and says what replaces it each time it is used.

`warn_deprecated` is for a deprecated argument or spelling inside a function; `deprecated_names` builds a
module `__getattr__` that keeps old attribute names importable.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

__all__ = ["Deprecated", "SlipstreamDeprecationWarning", "deprecated_names", "warn_deprecated"]


class SlipstreamDeprecationWarning(DeprecationWarning):
    """A Slipstream name or argument that still works but goes away in a later minor release."""


def _removal(since: str) -> str:
    """The first release that may drop a name deprecated in `since`: two minor releases later (0.2 -> 0.4),
    so at least one whole minor release carries the warning."""
    major, minor, *_ = (int(part) for part in since.split("."))
    return f"{major}.{minor + 2}"


def warn_deprecated(old: str, replacement: str, *, since: str, stacklevel: int = 3) -> None:
    """Warn that `old` is deprecated since `since`, naming `replacement` and the earliest removal."""
    warnings.warn(
        f"{old} is deprecated since Slipstream {since} and may be removed in {_removal(since)}; "
        f"use {replacement} instead.",
        SlipstreamDeprecationWarning,
        stacklevel=stacklevel,
    )


class Deprecated(NamedTuple):
    """An old module attribute: where its replacement lives ("package.module:Name") and since when."""

    target: str
    since: str


def deprecated_names(module: str, names: Mapping[str, Deprecated]) -> Callable[[str], Any]:
    """A module `__getattr__` that resolves each old name to its replacement, warning once per use."""

    def __getattr__(name: str) -> Any:
        entry = names.get(name)
        if entry is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        target_module, _, target_name = entry.target.partition(":")
        warn_deprecated(f"{module}.{name}", f"{target_module}.{target_name}", since=entry.since)
        return getattr(importlib.import_module(target_module), target_name)

    return __getattr__

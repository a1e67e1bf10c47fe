"""PyTorch version differences within the supported range (docs/support.md), in one place.

Public APIs that appeared after the oldest torch we support are reached through here, each with what the
older torch gets instead; a feature that cannot work on an older torch says which version it needs
(`require_torch`) instead of failing with an AttributeError deep inside.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

__all__ = ["TorchTooOld", "require_torch", "safe_globals", "torch_version"]


class TorchTooOld(RuntimeError):
    """A feature needs a newer PyTorch than the one installed."""


def torch_version(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of the installed torch, or of `version` (local suffixes such as `+cpu` ignored)."""
    found = re.match(r"(\d+)\.(\d+)", torch.__version__ if version is None else version)
    if found is None:
        raise ValueError(f"cannot read a torch version from {version or torch.__version__!r}")
    return int(found.group(1)), int(found.group(2))


def require_torch(minimum: str, feature: str) -> None:
    """Raise `TorchTooOld` naming `feature`, the version it needs and the installed one, when torch is older."""
    if torch_version() < torch_version(minimum):
        raise TorchTooOld(
            f"{feature} needs PyTorch >= {minimum}; this environment has torch {torch.__version__}. "
            f"Upgrade torch (pip install 'torch>={minimum}') or leave {feature} off."
        )


@contextlib.contextmanager
def safe_globals(allowed: Iterable[Any]) -> Iterator[None]:
    """Allow `allowed` in `torch.load(weights_only=True)` for the duration of the block.

    torch >= 2.5 scopes the allow-list to the block (`torch.serialization.safe_globals`); torch 2.4 has only
    the process-wide `add_safe_globals`, so there the classes stay allowed afterwards. They are Slipstream's
    inert stand-ins for DeepSpeed's classes and a few plain types, safe to leave allowed.
    """
    scoped = getattr(torch.serialization, "safe_globals", None)
    if scoped is not None:
        with scoped(list(allowed)):
            yield
        return
    torch.serialization.add_safe_globals(list(allowed))
    yield

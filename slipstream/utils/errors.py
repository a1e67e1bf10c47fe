"""Error types that keep Slipstream's messages and are also caught where DeepSpeed's callers catch.

DeepSpeed checks the arguments of its entry points with `assert`, so its callers (and its own tests) catch
`AssertionError`; Slipstream raises the natural type (ValueError, TypeError) with a message naming the
argument, its value and the fix. Each class here derives from both, so `except ValueError` and
`except AssertionError` both work. Used for the argument checks of `initialize()` and the engine's entry points.
"""

from __future__ import annotations

__all__ = ["ArgumentError", "ArgumentTypeError", "NotBuiltError"]


class ArgumentError(ValueError, AssertionError):
    """A wrong or missing argument of a DeepSpeed entry point (DeepSpeed asserts here)."""


class ArgumentTypeError(TypeError, AssertionError):
    """An argument of the wrong type for a DeepSpeed entry point (DeepSpeed asserts here)."""


class NotBuiltError(NotImplementedError):
    """A DeepSpeed feature that Slipstream does not implement; `feature` names it. Placeholders for DeepSpeed's
    names raise it (compat/unbuilt.py), and so does the launcher for `--autotuning`."""

    def __init__(self, feature: str, instead: str) -> None:
        self.feature = feature
        super().__init__(f"{feature} is not built in Slipstream; {instead}")

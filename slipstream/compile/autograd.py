"""Compiled autograd: the backward pass traced and compiled as one graph, where the installed torch has it.

torch 2.4 to 2.5 offer it as `torch._dynamo.compiled_autograd.enable(compiler_fn)`, later releases as
`_enable` (with `enable` gone); both are context managers around the backward call. The engine enters it
around `engine.backward`'s backward (as DeepSpeed does), not around a PyTorch-style `loss.backward()`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any


def compiled_autograd_entry() -> Callable[..., Any] | None:
    """torch's context manager that turns compiled autograd on, or None where this torch has none."""
    try:
        from torch._dynamo import compiled_autograd
    except ImportError:
        return None
    entry: Callable[..., Any] | None = getattr(compiled_autograd, "_enable", None) or getattr(
        compiled_autograd, "enable", None
    )
    return entry


def require_compiled_autograd() -> Callable[..., Any]:
    """The entry point, or an error naming the option when this torch has none."""
    entry = compiled_autograd_entry()
    if entry is None:
        import torch

        raise NotImplementedError(
            f"engine.compile(compiled_autograd_enabled=True): torch {torch.__version__} has no compiled autograd "
            "(torch._dynamo.compiled_autograd); pass compiled_autograd_enabled=False or install a torch that has it"
        )
    return entry


@contextlib.contextmanager
def compiled_backward(compiler: Callable[..., Any] | None) -> Iterator[None]:
    """Backward passes inside run through compiled autograd with `compiler`; nothing changes when it is None."""
    if compiler is None:
        yield
        return
    with require_compiled_autograd()(compiler):
        yield

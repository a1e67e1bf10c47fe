"""DeepSpeed's `engine.optimizer.parameter_offload` (its `DeepSpeedZeRoOffload`) as client code reaches into it.

TRL's `unwrap_model_for_generation` at ZeRO-3 gathers every parameter with `GatheredParameters`, then takes
DeepSpeed's per-module fetch/release hooks off the model for `generate()` and puts them back afterwards: it
clears each parameter's `ds_active_sub_modules` (over `parameter_offload.module.named_parameters()` and its
`ds_external_parameters()`), empties `forward_hooks` / `backward_hooks`, invalidates the coordinator's trace
and calls `_register_deepspeed_module(module)`. Slipstream's unit hooks need none of that: a unit that a user
gather holds is neither gathered again nor freed by them, so generation inside the gather runs without
collectives. The view therefore lists no hooks to remove, re-registers nothing, and its coordinator reports a
valid trace (Slipstream's order trace is checked on every forward, slipstream/zero/stage3/coordinator.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import nn


class _ModuleView:
    """The model as `parameter_offload.module`: the module itself, plus DeepSpeed's `ds_external_parameters()`
    (Slipstream registers parameters used across modules with units, not modules: none to list here)."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module

    def ds_external_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return iter(())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


class _CoordinatorView:
    """`parameter_offload.param_coordinator`: the trace is never stale (see the module doc)."""

    def is_invalid_trace(self) -> bool:
        return False

    def _invalidate_trace(self) -> None:
        return None


class ParameterOffloadView:
    """`engine.optimizer.parameter_offload` at ZeRO-3 (see the module doc)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = _ModuleView(module)
        self.forward_hooks: list[Any] = []
        self.backward_hooks: list[Any] = []
        self.param_coordinator = _CoordinatorView()

    def _register_deepspeed_module(self, module: object, count: object = None) -> None:
        """Slipstream's unit hooks never left the model: nothing to register again."""
        return None

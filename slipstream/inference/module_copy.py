"""A module's structure copied without its parameters' values, for an inference copy of a training model.

`structural_copy(module, placeholder)` returns a new module tree of the same classes and attributes (the
Hugging Face config, the generation config, the rotary tables are shared, not copied) in which every parameter
is `placeholder(parameter)` (one placeholder per parameter object, so tied weights stay tied) and nothing of the
training machinery is carried over: no hooks (the ZeRO-3 gather hooks, user hooks), no instance-level
`forward` (a wrapper bound to the original module would compute with the original's parameters), no
Slipstream bookkeeping attributes. Buffers are the original's tensors (read only while generating).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

__all__ = ["structural_copy"]

_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)
_NOT_COPIED = ("forward", "_z3_external_params")


def structural_copy(module: nn.Module, placeholder: Callable[[nn.Parameter], nn.Parameter]) -> nn.Module:
    """`module`'s tree with every parameter replaced by its placeholder (see the module doc)."""
    return _copy(module, placeholder, {}, {})


def _copy(
    module: nn.Module,
    placeholder: Callable[[nn.Parameter], nn.Parameter],
    params: dict[int, nn.Parameter],
    modules: dict[int, nn.Module],
) -> nn.Module:
    if id(module) in modules:  # a module reached twice (shared) stays one module
        return modules[id(module)]
    state = {
        key: value
        for key, value in module.__dict__.items()
        if key not in _NOT_COPIED and not key.startswith("_slipstream")
    }
    for key in _HOOK_DICTS:
        if key in state:
            state[key] = type(state[key])()
    new_params: dict[str, nn.Parameter | None] = {}
    for name, param in module._parameters.items():
        if param is not None and id(param) not in params:
            params[id(param)] = placeholder(param)
        new_params[name] = None if param is None else params[id(param)]
    state["_parameters"] = new_params
    state["_buffers"] = dict(module._buffers)
    state["_non_persistent_buffers_set"] = set(module._non_persistent_buffers_set)
    copy = object.__new__(type(module))
    modules[id(module)] = copy
    state["_modules"] = {
        name: None if child is None else _copy(child, placeholder, params, modules)
        for name, child in module._modules.items()
    }
    copy.__dict__.update(state)
    return copy

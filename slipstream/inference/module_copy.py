"""A module's structure copied without its parameters' values, for an inference copy of a training model.

`structural_copy(module, placeholder)` returns a new module tree of the same classes and attributes (the
Hugging Face config, the generation config, the rotary tables are shared, not copied) in which every parameter
is `placeholder(parameter)` (one placeholder per parameter object, so tied weights stay tied) and nothing of the
training machinery is carried over: no hooks (the ZeRO-3 gather hooks, user hooks), no instance-level
`forward` (a wrapper bound to the original module would compute with the original's parameters), no
Slipstream bookkeeping attributes. Buffers are the original's tensors (read only while generating). A
`substitute` may put another module in a submodule's place (the hybrid engine's split copy holds a LoRA layer
as the plain linear it computes once fused; inference/lora.py `linear_stand_in`).
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


Placeholder = Callable[[nn.Parameter], nn.Parameter]
Substitute = Callable[[nn.Module, Placeholder], "nn.Module | None"]
"""(module, placeholder) -> the module the copy holds in its place (made with `placeholder` for its parameters),
or None to copy it as it is."""


def structural_copy(module: nn.Module, placeholder: Placeholder, substitute: Substitute | None = None) -> nn.Module:
    """`module`'s tree with every parameter replaced by its placeholder (see the module doc). Where `substitute`
    returns a module for a submodule, the copy holds that one instead (a LoRA layer's plain linear)."""
    return _Copier(placeholder, substitute).copy(module)


class _Copier:
    def __init__(self, placeholder: Placeholder, substitute: Substitute | None) -> None:
        self.placeholder, self.substitute = placeholder, substitute
        self.params: dict[int, nn.Parameter] = {}
        self.modules: dict[int, nn.Module] = {}

    def param(self, param: nn.Parameter) -> nn.Parameter:
        """One placeholder per parameter object, so tied weights stay tied."""
        if id(param) not in self.params:
            self.params[id(param)] = self.placeholder(param)
        return self.params[id(param)]

    def copy(self, module: nn.Module) -> nn.Module:
        if id(module) in self.modules:  # a module reached twice (shared) stays one module
            return self.modules[id(module)]
        swapped = None if self.substitute is None else self.substitute(module, self.param)
        if swapped is not None:
            self.modules[id(module)] = swapped
            return swapped
        state = {
            key: value
            for key, value in module.__dict__.items()
            if key not in _NOT_COPIED and not key.startswith("_slipstream")
        }
        for key in _HOOK_DICTS:
            if key in state:
                state[key] = type(state[key])()
        state["_parameters"] = {
            name: None if param is None else self.param(param) for name, param in module._parameters.items()
        }
        state["_buffers"] = dict(module._buffers)
        state["_non_persistent_buffers_set"] = set(module._non_persistent_buffers_set)
        copy = object.__new__(type(module))
        self.modules[id(module)] = copy
        state["_modules"] = {
            name: None if child is None else self.copy(child) for name, child in module._modules.items()
        }
        copy.__dict__.update(state)
        return copy

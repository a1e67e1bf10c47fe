"""DeepSpeed names whose feature Slipstream does not have: each imports, and using it raises `NotBuiltError`
naming the feature and what to do instead.

They exist so that client code which imports them at the top of a file (Megatron-DeepSpeed imports the data
pipeline and inference names whether it uses them or not) still imports, and fails only where the missing
feature is used, with a message saying so. compat/alias_table.py declares their DeepSpeed paths.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from slipstream.utils.errors import NotBuiltError

__all__ = ["NotBuiltError", "not_built_class", "not_built_function"]


def not_built_function(name: str, feature: str, instead: str) -> Callable[..., Any]:
    """A function `name` that raises NotBuiltError(feature) when called."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NotBuiltError(feature, instead)

    refuse.__name__ = refuse.__qualname__ = name
    refuse.__doc__ = f"DeepSpeed's `{name}`: {feature} is not built in Slipstream ({instead})."
    return refuse


def not_built_class(name: str, feature: str, instead: str) -> type:
    """A class `name` whose construction raises NotBuiltError(feature) (it can still be subclassed or named in
    an isinstance check, which is all code that merely mentions it does)."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        raise NotBuiltError(feature, instead)

    doc = f"DeepSpeed's `{name}`: {feature} is not built in Slipstream ({instead})."
    return type(name, (), {"__init__": __init__, "__doc__": doc, "__module__": __name__})


@dataclasses.dataclass(frozen=True)
class _Feature:
    """A DeepSpeed feature Slipstream lacks, what to do instead, and the names of its classes and functions."""

    what: str
    instead: str
    classes: tuple[str, ...] = ()
    functions: tuple[str, ...] = ()


_FEATURES = (
    _Feature(
        "autotuning (`deepspeed --autotuning tune|run`)",
        "launch without --autotuning and set the config",
        classes=("Autotuner",),
    ),
    _Feature(
        "offloading ZeRO states between steps (offload_states / reload_states)",
        "use zero_optimization.offload_optimizer / offload_param",
        functions=(
            "offload_optimizer_states",
            "reload_optimizer_states",
            "offload_adam_states",
            "reload_adam_states",
            "get_state_devices",
        ),
    ),
    _Feature(
        "DeepSpeed's ZeRO-3 parameter offload object (DeepSpeedZeRoOffload)",
        "ZeRO-3 gathers through its own units; use deepspeed.zero.GatheredParameters",
        classes=("DeepSpeedZeRoOffload",),
    ),
    _Feature(
        "DeepSpeed's pipeline p2p module (stage-to-stage send/recv by stage index)",
        "Slipstream's pipeline engine exchanges activations itself (slipstream/pipe/exchange.py)",
        functions=("send", "recv", "wait", "send_obj", "recv_obj"),
    ),
)

_PLACEHOLDERS: dict[str, object] = {
    **{name: not_built_class(name, f.what, f.instead) for f in _FEATURES for name in f.classes},
    **{name: not_built_function(name, f.what, f.instead) for f in _FEATURES for name in f.functions},
}


def __getattr__(name: str) -> object:
    """The placeholders of `_FEATURES` are this module's attributes (built once; alias_table.py names them)."""
    try:
        return _PLACEHOLDERS[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


launch_main = not_built_function(
    "main",
    "DeepSpeed's per-node launcher command line (deepspeed.launcher.launch --world_info ...)",
    "launch with `deepspeed` / `slipstream run` (one host), or `slipstream run --node_rank N` on each node",
)

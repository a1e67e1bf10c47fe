"""DeepSpeed names whose feature Slipstream does not have: each imports, and using it raises `NotBuiltError`
naming the feature and what to do instead.

They exist so that client code which imports them at the top of a file (Megatron-DeepSpeed imports the data
pipeline and inference names whether it uses them or not) still imports, and fails only where the missing
feature is used, with a message saying so. compat/alias_table.py declares their DeepSpeed paths.
"""

from __future__ import annotations

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


_AUTOTUNING = ("autotuning (`deepspeed --autotuning tune|run`)", "launch without --autotuning and set the config")
Autotuner = not_built_class("Autotuner", *_AUTOTUNING)

_DATA = ("DeepSpeed's data efficiency pipeline (curriculum learning, random-LTD)", "remove data_efficiency")
DeepSpeedDataSampler = not_built_class("DeepSpeedDataSampler", *_DATA)
CurriculumScheduler = not_built_class("CurriculumScheduler", *_DATA)
RandomLayerTokenDrop = not_built_class("RandomLayerTokenDrop", *_DATA)
convert_to_random_ltd = not_built_function("convert_to_random_ltd", *_DATA)
save_without_random_ltd = not_built_function("save_without_random_ltd", *_DATA)
remove_random_ltd_state_dict = not_built_function("remove_random_ltd_state_dict", *_DATA)

_OFFLOAD_STATES = (
    "offloading ZeRO states between steps (offload_states / reload_states)",
    "use zero_optimization.offload_optimizer / offload_param",
)
offload_optimizer_states = not_built_function("offload_optimizer_states", *_OFFLOAD_STATES)
reload_optimizer_states = not_built_function("reload_optimizer_states", *_OFFLOAD_STATES)
offload_adam_states = not_built_function("offload_adam_states", *_OFFLOAD_STATES)
reload_adam_states = not_built_function("reload_adam_states", *_OFFLOAD_STATES)
get_state_devices = not_built_function("get_state_devices", *_OFFLOAD_STATES)

_OFFLOAD_HOOKS = (
    "DeepSpeed's ZeRO-3 parameter offload object (DeepSpeedZeRoOffload)",
    "ZeRO-3 gathers through its own units; use deepspeed.zero.GatheredParameters",
)
DeepSpeedZeRoOffload = not_built_class("DeepSpeedZeRoOffload", *_OFFLOAD_HOOKS)

_P2P = (
    "DeepSpeed's pipeline p2p module (stage-to-stage send/recv by stage index)",
    "Slipstream's pipeline engine exchanges activations itself (slipstream/pipe/exchange.py)",
)
send = not_built_function("send", *_P2P)
recv = not_built_function("recv", *_P2P)
wait = not_built_function("wait", *_P2P)
send_obj = not_built_function("send_obj", *_P2P)
recv_obj = not_built_function("recv_obj", *_P2P)

launch_main = not_built_function(
    "main",
    "DeepSpeed's per-node launcher command line (deepspeed.launcher.launch --world_info ...)",
    "launch with `deepspeed` / `slipstream run` (one host), or `slipstream run --node_rank N` on each node",
)

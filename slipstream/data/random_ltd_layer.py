"""DeepSpeed's random-LTD layer API: `RandomLayerTokenDrop` (a layer wrapper), `convert_to_random_ltd` (wraps
every layer of a type, then `engine.random_ltd_initialize()`), `save_without_random_ltd` and
`remove_random_ltd_state_dict` (state dict keys without the wrapper's `.random_ltd_layer`).

`attach_random_ltd` is the engine's `random_ltd_initialize`: the wrappers, in module order, whose module name
has the next id of `random_ltd_layer_id` (sorted) as a dot-separated component ("layers.3" for id 3) become
dropping layers 0, 1, ...; the others stay plain (they run the full sequence). DeepSpeed tests the id as a
substring of the name, which also matches "gpt2.h.0" for id 2; the whole component is matched here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

import torch
from torch import nn

from slipstream.config.random_ltd_plan import RandomLTDPlan
from slipstream.data.random_ltd import RandomLTDScheduler, draw_tokens, gather_tokens, scatter_tokens

__all__ = [
    "RandomLayerTokenDrop",
    "attach_random_ltd",
    "convert_to_random_ltd",
    "remove_random_ltd_state_dict",
    "save_without_random_ltd",
]

_WRAPPED = ".random_ltd_layer"


class RandomLayerTokenDrop(nn.Module):
    """Runs `layer` on the kept tokens only, in training, once `init_config` made it a dropping layer (see
    [Note: random-LTD tokens] in data/random_ltd.py). The layer's first argument is the hidden states; its output
    a tensor or a tuple whose first element is the hidden states."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.random_ltd_layer = layer
        self.random_ltd_scheduler: RandomLTDScheduler | None = None
        self.random_ltd_layer_id = -1
        self.batch_first = True
        self.mask_name: str | None = None
        self.encoder = False

    def init_config(self, plan: RandomLTDPlan, scheduler: RandomLTDScheduler, random_ltd_layer_id: int) -> None:
        """Make this the `random_ltd_layer_id`-th dropping layer of `scheduler`."""
        self.random_ltd_scheduler = scheduler
        self.random_ltd_layer_id = random_ltd_layer_id
        self.batch_first = plan.hidden_state_order == "batch_seq_dim"
        self.mask_name = plan.model_mask_name
        self.encoder = plan.model_type == "encoder"

    def forward(self, hidden_states: torch.Tensor, **kwargs: object) -> object:
        scheduler = self.random_ltd_scheduler
        seq_dim = 1 if self.batch_first else 0
        if not self.training or scheduler is None or scheduler.get_current_seq() >= hidden_states.shape[seq_dim]:
            return self.random_ltd_layer(hidden_states, **kwargs)
        draw = scheduler.draw
        if self.random_ltd_layer_id == 0 or draw is None:
            draw = scheduler.draw = draw_tokens(
                scheduler.get_current_seq(),
                seq_len=hidden_states.shape[seq_dim],
                batch=hidden_states.shape[1 - seq_dim],
                layers=scheduler.random_ltd_layer_num,
                device=hidden_states.device,
                mask=self._mask(kwargs),
                encoder=self.encoder,
            )
        rows = draw.indices[self.random_ltd_layer_id]
        if self.mask_name is not None:
            kwargs[self.mask_name] = draw.masks[self.random_ltd_layer_id]
        outputs = self.random_ltd_layer(gather_tokens(hidden_states, rows, batch_first=self.batch_first), **kwargs)
        if isinstance(outputs, torch.Tensor):
            return scatter_tokens(hidden_states, outputs, rows, batch_first=self.batch_first)
        if isinstance(outputs, tuple) and outputs and isinstance(outputs[0], torch.Tensor):
            return (scatter_tokens(hidden_states, outputs[0], rows, batch_first=self.batch_first), *outputs[1:])
        raise TypeError(
            f"RandomLayerTokenDrop: the wrapped {type(self.random_ltd_layer).__name__} returned "
            f"{type(outputs).__name__}; random-LTD needs a tensor or a tuple whose first element is the hidden states"
        )

    def _mask(self, kwargs: Mapping[str, object]) -> torch.Tensor | None:
        if self.mask_name is None:
            if self.encoder:
                raise ValueError(_needs_mask("is not set"))
            return None
        mask = kwargs.get(self.mask_name)
        if mask is None and self.encoder:
            raise ValueError(_needs_mask(f"names {self.mask_name!r}, which the layer did not receive"))
        if mask is not None and not isinstance(mask, torch.Tensor):
            raise TypeError(f"random-LTD: the layer's {self.mask_name!r} is a {type(mask).__name__}, not a tensor")
        return mask


def _needs_mask(what: str) -> str:
    return (
        f"random-LTD with model_type 'encoder' needs the attention mask, but model_mask_name {what}; pass the mask "
        "to the layer as a keyword argument and name it in data_efficiency.data_routing.random_ltd.model_mask_name"
    )


def attach_random_ltd(module: nn.Module, plan: RandomLTDPlan, scheduler: RandomLTDScheduler) -> int:
    """Configure the wrappers of `module` named by `plan.random_ltd_layer_id` (module doc); returns how many."""
    waiting = sorted(plan.random_ltd_layer_id)
    count = 0
    for name, layer in module.named_modules():
        if isinstance(layer, RandomLayerTokenDrop) and waiting and str(waiting[0]) in name.split("."):
            layer.init_config(plan, scheduler, count)
            waiting.pop(0)
            count += 1
    if count != plan.random_ltd_layer_num:
        wrapped = [name for name, layer in module.named_modules() if isinstance(layer, RandomLayerTokenDrop)]
        raise ValueError(
            f"random-LTD: random_ltd_layer_num is {plan.random_ltd_layer_num} but only {count} wrapped layers match "
            f"random_ltd_layer_id {list(plan.random_ltd_layer_id)} (wrapped: {wrapped}); wrap those layers with "
            "convert_to_random_ltd, or fix the ids"
        )
    return count


def convert_to_random_ltd(model: nn.Module, convert_type: type[nn.Module]) -> nn.Module:
    """Wrap every `convert_type` layer of `model` (an engine: its module) in `RandomLayerTokenDrop`, then let the
    engine configure them (`model.random_ltd_initialize()`). Returns `model`."""
    inner = model.module if isinstance(getattr(model, "module", None), nn.Module) else model
    assert isinstance(inner, nn.Module)
    names = [name for name, layer in inner.named_modules() if isinstance(layer, convert_type) and name]
    outermost = [n for n in names if not any(n.startswith(other + ".") for other in names)]
    for name in outermost:
        parent_name, _, child = name.rpartition(".")
        parent = inner.get_submodule(parent_name) if parent_name else inner
        setattr(parent, child, RandomLayerTokenDrop(inner.get_submodule(name)))
    initialize = getattr(model, "random_ltd_initialize", None)
    if not callable(initialize):
        raise TypeError(
            f"convert_to_random_ltd: {type(model).__name__} has no random_ltd_initialize(); pass the engine that "
            "slipstream.initialize returned (with data_efficiency.data_routing.random_ltd enabled)"
        )
    initialize()
    return model


def save_without_random_ltd(model: nn.Module) -> OrderedDict[str, torch.Tensor]:
    """The state dict of `model` (an engine: its module) with the wrapper's name level removed."""
    wrapped = getattr(model, "module", None)
    inner = wrapped if isinstance(wrapped, nn.Module) else model
    return remove_random_ltd_state_dict(inner.state_dict())


def remove_random_ltd_state_dict(state_dict: Mapping[str, torch.Tensor]) -> OrderedDict[str, torch.Tensor]:
    """`state_dict` with every `.random_ltd_layer` removed from its keys."""
    return OrderedDict((key.replace(_WRAPPED, ""), value) for key, value in state_dict.items())

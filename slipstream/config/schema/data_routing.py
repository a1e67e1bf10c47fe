"""`data_efficiency.data_routing`: random layerwise token dropping (random-LTD). The wrapped layers of a model
(`RandomLayerTokenDrop`, slipstream/data/random_ltd_layer.py) run on a random subset of the tokens whose size
grows on a schedule; the other tokens pass those layers unchanged. Open sections, as DeepSpeed keeps every key
of them; the keys listed here are type-checked and honoured, any other key is reported as not implemented."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from slipstream.config.schema.base import DSBool, DSInt, OpenSection, plan_fields

__all__ = ["DataRoutingConfig", "RandomLTDConfig", "RandomLTDScheduleConfig", "RandomLTDStepsConfig"]

_PLAN = "schedules.random_ltd"


class RandomLTDStepsConfig(OpenSection):
    """`random_ltd.random_ltd_schedule.schedule_config`."""

    IMPLEMENTED = plan_fields(_PLAN, "require_steps", "seq_per_step")

    require_steps: DSInt | None = None
    """Steps from min_value kept tokens to max_value."""
    seq_per_step: DSInt | None = None
    """The kept count is a multiple of this (8 or 16 suit tensor cores)."""


class RandomLTDScheduleConfig(OpenSection):
    """`random_ltd.random_ltd_schedule`: how many tokens the wrapped layers keep at each step."""

    IMPLEMENTED = plan_fields(_PLAN, "min_value", "max_value", "schedule_type", schedule_config=_PLAN)

    min_value: DSInt | None = None
    """Tokens kept at step 0."""
    max_value: DSInt | None = None
    """Tokens kept once the schedule ends (the full sequence length: nothing is dropped then)."""
    schedule_type: Literal["fixed_linear"] = "fixed_linear"
    """How the kept count grows with the step (DeepSpeed has fixed_linear only)."""
    schedule_config: RandomLTDStepsConfig = RandomLTDStepsConfig()
    """The schedule's parameters."""


class LayerTokenLRConfig(OpenSection):
    """`random_ltd.layer_token_lr_schedule`: a learning rate scheduled by consumed layer tokens. DeepSpeed
    raises when it is enabled; here it is reported as not implemented."""

    enabled: DSBool = False
    """Schedule the learning rate by layer tokens."""


class RandomLTDConfig(OpenSection):
    """`data_efficiency.data_routing.random_ltd` (engine.random_ltd_initialize / convert_to_random_ltd)."""

    IMPLEMENTED = plan_fields(
        _PLAN,
        "model_type",
        "hidden_state_order",
        "random_ltd_layer_num",
        "random_ltd_layer_id",
        "model_mask_name",
        "total_layer_num",
        enabled=_PLAN,
        random_ltd_schedule=_PLAN,
    )

    enabled: DSBool = False
    """Drop tokens in the wrapped layers in training (DeepSpeed needs no other switch for it)."""
    model_name: str | None = None
    """A label for the model; DeepSpeed reads it nowhere."""
    model_type: Literal["decoder", "encoder"] = "decoder"
    """decoder: the causal mask is cut to the kept count; encoder: the mask's rows and columns of the kept tokens
    are gathered (the mask is then required)."""
    hidden_state_order: Literal["batch_seq_dim", "seq_batch_dim"] = "batch_seq_dim"
    """The layout of the hidden states the wrapped layers receive: [batch, seq, hidden] or [seq, batch, hidden]."""
    random_ltd_layer_num: DSInt | None = None
    """How many layers drop tokens (the length of random_ltd_layer_id)."""
    random_ltd_layer_id: list[DSInt] | None = None
    """Which wrapped layers drop tokens: a wrapped layer whose module name has one of these numbers as a
    component ("layers.3")."""
    model_mask_name: str | None = None
    """The keyword argument of the layer's forward that holds the attention mask; None: no mask is passed."""
    total_layer_num: DSInt | None = None
    """Layers of the model in all (for the consumed layer-token count)."""
    random_ltd_schedule: RandomLTDScheduleConfig = RandomLTDScheduleConfig()
    """The kept-token schedule."""
    layer_token_lr_schedule: LayerTokenLRConfig = Field(default_factory=LayerTokenLRConfig)
    """The layer-token learning-rate schedule (not implemented)."""


class DataRoutingConfig(OpenSection):
    """`data_efficiency.data_routing`: its one method is random-LTD."""

    IMPLEMENTED = plan_fields(_PLAN, enabled=_PLAN)

    enabled: DSBool = False
    """The routing switch (DeepSpeed turns random-LTD on by random_ltd.enabled alone, and so does Slipstream)."""
    random_ltd: RandomLTDConfig = Field(default_factory=RandomLTDConfig)
    """Random layerwise token dropping."""

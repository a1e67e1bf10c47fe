"""DeepSpeed's `ds_*` parameter attributes, by the path they had here: the mixin lives with the sharded parameter
type that carries it (zero/stage3/param_attrs.py)."""

from __future__ import annotations

from slipstream.zero.stage3.param_attrs import DeepSpeedParamAttrs

__all__ = ["DeepSpeedParamAttrs"]

"""`sparsity_config(section, num_heads)`: the layout object of a `sparse_attention` config section.

`section` is DeepSpeed's dictionary of the section, as `DeepSpeedConfig(config).sparse_attention` gives it (its `mode` and that mode's keys, defaults filled by the config
reader, config/sparse_attention_plan.py), or a section as written (missing keys take the layout class's
defaults). The number of heads is the model's, which the section does not hold.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from slipstream.ops.sparse_attention.layouts import (
    DenseSparsityConfig,
    FixedSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
)
from slipstream.ops.sparse_attention.sparsity_window import BigBirdSparsityConfig, BSLongformerSparsityConfig

__all__ = ["sparsity_config"]

_LAYOUTS: dict[str, type[SparsityConfig]] = {
    "dense": DenseSparsityConfig,
    "fixed": FixedSparsityConfig,
    "variable": VariableSparsityConfig,
    "bigbird": BigBirdSparsityConfig,
    "bslongformer": BSLongformerSparsityConfig,
}


def sparsity_config(section: Mapping[str, Any], num_heads: int) -> SparsityConfig:
    """The `SparsityConfig` subclass of the section's `mode` (default "fixed"), built with its keys."""
    params = dict(section)
    mode = params.pop("mode", "fixed")
    layout = _LAYOUTS.get(mode)
    if layout is None:
        raise ValueError(f"sparse_attention.mode: {mode!r} is not a layout mode; use one of {sorted(_LAYOUTS)}")
    try:
        return layout(num_heads=num_heads, **params)
    except TypeError as exc:
        raise ValueError(f"sparse_attention (mode {mode!r}): {exc}; see {layout.__name__}'s arguments") from None

"""`SparseAttentionPlan`: the `sparse_attention` section, checked and completed as DeepSpeed's config reader did
(re-exported by config/plan.py; `slipstream.ops.sparse_attention.sparsity_config` turns it into a layout).

DeepSpeed never applied the section itself: its config reader validated it and filled each mode's keys with their
defaults, and the user's model built a `SparsityConfig` from that dictionary (DeepSpeed 0.19 removed the section
and refuses it). Here the same dictionary is `DeepSpeedConfig(config).sparse_attention`
(slipstream.compat.ds_config, DeepSpeed's path deepspeed.runtime.config), and
`slipstream.ops.sparse_attention.sparsity_config(that_dict, num_heads)` builds the layout object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["MODE_KEYS", "SparseAttentionPlan", "sparse_attention_plan"]

_COMMON: dict[str, Any] = {"block": 16, "different_layout_per_head": False}
MODE_KEYS: dict[str, dict[str, Any]] = {
    "dense": {"block": 16},
    "fixed": {
        **_COMMON,
        "num_local_blocks": 4,
        "num_global_blocks": 1,
        "attention": "bidirectional",
        "horizontal_global_attention": False,
        "num_different_global_patterns": 1,
    },
    "variable": {
        **_COMMON,
        "num_random_blocks": 0,
        "local_window_blocks": [4],
        "global_block_indices": [0],
        "global_block_end_indices": None,
        "attention": "bidirectional",
        "horizontal_global_attention": False,
    },
    "bigbird": {**_COMMON, "num_random_blocks": 0, "num_sliding_window_blocks": 3, "num_global_blocks": 1},
    "bslongformer": {
        **_COMMON,
        "num_sliding_window_blocks": 3,
        "global_block_indices": [0],
        "global_block_end_indices": None,
    },
}
"""Each mode's keys and DeepSpeed's defaults for them (its config constants)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SparseAttentionPlan:
    """A layout mode and its keys, every one filled."""

    mode: str
    params: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        """DeepSpeed's dictionary: `mode` and the mode's keys."""
        return {"mode": self.mode, **self.params}


def sparse_attention_plan(section: dict[str, Any] | None, problems: list[str]) -> SparseAttentionPlan | None:
    """The plan of a `sparse_attention` section (None without one); a bad mode or key goes to `problems`."""
    if section is None:
        return None
    given = dict(section)
    mode = given.pop("mode", "fixed")
    if mode not in MODE_KEYS:
        problems.append(f"sparse_attention.mode: {mode!r} is not a layout mode; use one of {sorted(MODE_KEYS)}")
        return None
    defaults = MODE_KEYS[mode]
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        problems.append(
            f"sparse_attention: {', '.join(unknown)} is not a key of mode {mode!r}; its keys are {sorted(defaults)}"
        )
        return None
    return SparseAttentionPlan(mode=mode, params={**defaults, **given})

"""The memory planner: what every ZeRO option needs per device and per host, from the engine's own layout rules.

`estimate(...)` returns a typed `Plan` (one `OptionEstimate` per option); `format_plan`, `plan_json` and
`draw_png` present it (the `slipstream plan` command, cli/plan.py); DeepSpeed's estimator names live in
`deepspeed_names`; `engine_line` and `should_warn_materialised` are what the engine asks at start. Modules:
`types` (dataclasses), `zero_bytes` (model states per stage), `prefetch` (the stage-3 gather pool), `shapes`
(models, HF configs, synthetic decoders on the meta device), `activations`, `estimate`, `report`.
Importing this package does not import torch; building a model shape does. See docs/planner.md.
"""

from __future__ import annotations

from slipstream.planner.deepspeed_names import (
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
)
from slipstream.planner.engine_hooks import (
    MATERIALISED_WARN_NUMEL,
    engine_estimate,
    engine_line,
    materialised_warning,
    should_warn_materialised,
)
from slipstream.planner.estimate import estimate, estimate_option, settings_from_config, settings_from_plan
from slipstream.planner.report import draw_png, format_plan, plan_json
from slipstream.planner.types import STANDARD_OPTIONS, Option, OptionEstimate, Plan, Settings

__all__ = [
    "MATERIALISED_WARN_NUMEL",
    "STANDARD_OPTIONS",
    "Option",
    "OptionEstimate",
    "Plan",
    "Settings",
    "draw_png",
    "engine_estimate",
    "engine_line",
    "estimate",
    "estimate_option",
    "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero2_model_states_mem_needs_all_live",
    "estimate_zero3_model_states_mem_needs_all_cold",
    "estimate_zero3_model_states_mem_needs_all_live",
    "format_plan",
    "materialised_warning",
    "plan_json",
    "settings_from_config",
    "settings_from_plan",
    "should_warn_materialised",
]

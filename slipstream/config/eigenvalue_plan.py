"""`EigenvaluePlan`: the block-Hessian eigenvalues of the `eigenvalue` section (re-exported by config/plan.py;
engine/eigenvalue_steps.py drives slipstream/profiling/eigenvalue.py with it).

DeepSpeed computed them only for its Mixture-of-Quantization schedule (`quantize_training`), which switches a
block's precision by its eigenvalue; that use is not built, so with both sections enabled it is reported by
name (`eigenvalue.quantize_training`), and the values go to the monitors only. At ZeRO stage 3 the section is
reported as a whole (engine/eigenvalue_steps.py says why).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from slipstream.config.same_named import same_named

if TYPE_CHECKING:
    from slipstream.config.schema.top import DeepSpeedConfig

__all__ = ["EigenvaluePlan", "eigenvalue_plan"]


@dataclass(frozen=True, kw_only=True, slots=True)
class EigenvaluePlan:
    """Power iteration on the Hessian of each of the first `layer_num` blocks of `layer_name`."""

    verbose: bool
    max_iter: int
    tol: float
    stability: float
    every_steps: int
    """Computed at optimizer steps every_steps, 2 * every_steps, ... (1-based): gas_boundary_resolution."""
    layer_name: str
    layer_num: int


def eigenvalue_plan(cfg: DeepSpeedConfig, unimplemented: list[str]) -> EigenvaluePlan | None:
    """The plan when the section is enabled (None otherwise; the schema checked the keys)."""
    section = cfg.eigenvalue
    if not section.enabled:
        return None
    if cfg.zero_optimization.stage == 3:
        unimplemented.append("eigenvalue")
        return None
    if cfg.quantize_training.enabled:
        unimplemented.append("eigenvalue.quantize_training")
    return same_named(section, EigenvaluePlan, every_steps=section.gas_boundary_resolution)

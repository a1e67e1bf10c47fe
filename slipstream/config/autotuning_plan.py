"""The plan of the `autotuning` section (re-exported by config/plan.py with the other plans; its own module keeps
plan.py within the size limit)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AutotuningPlan"]


@dataclass(frozen=True, kw_only=True, slots=True)
class AutotuningPlan:
    """The `autotuning` section: the tuner's search (slipstream/autotuning/) and a profiled run's metrics."""

    enabled: bool
    """The engine writes its step metrics to `metric_path` after `end_profile_step` and exits."""
    metric_path: str
    results_dir: str
    exps_dir: str
    overwrite: bool
    metric: str
    """"throughput" (samples/s, higher wins) or "latency" (s per step, lower wins)."""
    start_profile_step: int
    end_profile_step: int
    fast: bool
    """True: the reduce bucket size is left as configured (not a dimension of the search)."""
    max_train_batch_size: int | None
    min_train_batch_size: int
    """Smallest global batch (micro x accumulation x data-parallel ranks) a candidate may have."""
    min_micro_batch_size: int
    max_micro_batch_size: int
    num_tuning_micro_batch_sizes: int
    tuner_num_trials: int
    tuner_early_stopping: int
    tuner_type: str
    """"gridsearch", "random" or "model_based" (slipstream/autotuning/order.py)."""
    arg_mappings: dict[str, str]
    mp_size: int
    """Model-parallel ranks per data-parallel replica: the tuner's batch arithmetic and the planner's figures use
    `world / mp_size` data-parallel ranks."""

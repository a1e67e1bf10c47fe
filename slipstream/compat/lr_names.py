"""DeepSpeed's learning-rate schedule names and parameter keys (`deepspeed.runtime.lr_schedules`' constants).

The schedule classes live in `slipstream/engine/lr_schedules.py`; `slipstream.runtime.lr_schedules` shows them
together with these constants (compat/aliases.py). `add_tuning_arguments` adds DeepSpeed's schedule-tuning
command-line flags.
"""

from __future__ import annotations

import argparse

LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]

LR_RANGE_TEST_MIN_LR = "lr_range_test_min_lr"
LR_RANGE_TEST_STEP_RATE = "lr_range_test_step_rate"
LR_RANGE_TEST_STEP_SIZE = "lr_range_test_step_size"
LR_RANGE_TEST_STAIRCASE = "lr_range_test_staircase"
EDGE_VALUE = "edge_value"
MID_VALUE = "mid_value"
CYCLE_FIRST_STEP_SIZE = "cycle_first_step_size"
CYCLE_FIRST_STAIR_COUNT = "cycle_first_stair_count"
CYCLE_SECOND_STEP_SIZE = "cycle_second_step_size"
CYCLE_SECOND_STAIR_COUNT = "cycle_second_stair_count"
DECAY_STEP_SIZE = "decay_step_size"
CYCLE_MIN_LR = "cycle_min_lr"
CYCLE_MAX_LR = "cycle_max_lr"
DECAY_LR_RATE = "decay_lr_rate"
CYCLE_MIN_MOM = "cycle_min_mom"
CYCLE_MAX_MOM = "cycle_max_mom"
DECAY_MOM_RATE = "decay_mom_rate"
WARMUP_MIN_LR = "warmup_min_lr"
WARMUP_MAX_LR = "warmup_max_lr"
WARMUP_NUM_STEPS = "warmup_num_steps"
WARMUP_TYPE = "warmup_type"
WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"
WARMUP_MIN_RATIO = "warmup_min_ratio"
COS_MIN_RATIO = "cos_min_ratio"
TOTAL_NUM_STEPS = "total_num_steps"

_FLAGS: tuple[tuple[str, type, object], ...] = (
    (LR_RANGE_TEST_MIN_LR, float, 0.001),
    (LR_RANGE_TEST_STEP_RATE, float, 1.0),
    (LR_RANGE_TEST_STEP_SIZE, int, 1000),
    (LR_RANGE_TEST_STAIRCASE, bool, False),
    (CYCLE_FIRST_STEP_SIZE, int, 1000),
    (CYCLE_FIRST_STAIR_COUNT, int, -1),
    (CYCLE_SECOND_STEP_SIZE, int, -1),
    (CYCLE_SECOND_STAIR_COUNT, int, -1),
    (DECAY_STEP_SIZE, int, 1000),
    (CYCLE_MIN_LR, float, 0.01),
    (CYCLE_MAX_LR, float, 0.1),
    (DECAY_LR_RATE, float, 0.0),
    (CYCLE_MIN_MOM, float, 0.8),
    (CYCLE_MAX_MOM, float, 0.9),
    (DECAY_MOM_RATE, float, 0.0),
    (WARMUP_MIN_LR, float, 0.0),
    (WARMUP_MAX_LR, float, 0.001),
    (WARMUP_NUM_STEPS, int, 1000),
    (WARMUP_TYPE, str, WARMUP_LOG_RATE),
)


def add_tuning_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's "Convergence Tuning" flags: `--lr_schedule` and each schedule parameter (same defaults)."""
    group = parser.add_argument_group("Convergence Tuning", "Convergence tuning configurations")
    group.add_argument(f"--{LR_SCHEDULE}", type=str, default=None, help="LR schedule for training.")
    for name, kind, default in _FLAGS:
        group.add_argument(f"--{name}", type=kind, default=default, help=f"{name} (DeepSpeed's schedule parameter)")
    return parser

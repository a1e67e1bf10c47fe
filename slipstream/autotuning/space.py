"""The search space: one `Candidate` per ZeRO stage x offload (none, the optimizer, at stage 3 also the optimizer
and the parameters, to the CPU) x micro batch (x reduce bucket size when
`autotuning.fast` is false; x activation checkpointing on/off when the config has an `activation_checkpointing`
section), the gradient accumulation that keeps `train_batch_size` when the config fixes it, and the DeepSpeed
config of each candidate (the user's config with the candidate's keys written over it).

[Note: how a job sees activation checkpointing]
DeepSpeed has no on/off key: a model checkpoints by calling `deepspeed.checkpointing.checkpoint`, and the
`activation_checkpointing` section only configures that call. The tuner searches the dimension only for a config
that has the section: "on" keeps it, "off" drops it from the candidate's config. The script sees the choice in
the config it is given (the section is there or not; in Slipstream also as `engine.plan.activation_checkpointing`
not being None) and wraps its blocks in `checkpoint` only when it is on. The engine has no model-level switch for
Hugging Face models (`gradient_checkpointing_enable`), so such a script turns it on itself from the same test.
"""

from __future__ import annotations

import copy
import dataclasses
import json

from slipstream.config.plan import AutotuningPlan

__all__ = [
    "BUCKET_SIZES",
    "Candidate",
    "candidate_config",
    "grid",
    "micro_batch_sizes",
    "optimal_config",
    "tunable_config",
    "zero_stages",
]

OFFLOADS = {0: ((False, False),), 1: ((False, False), (True, False)), 2: ((False, False), (True, False))}
OFFLOADS[3] = (*OFFLOADS[2], (True, True))
"""Per stage, the (optimizer, parameter) offloads to the CPU searched."""
BUCKET_SIZES = (50_000_000, 500_000_000, 1_000_000_000)
"""Reduce bucket sizes tried when `autotuning.fast` is false (DeepSpeed's tuning space for stages 1-3)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    """One configuration to consider: what the tuner writes over the user's config."""

    stage: int
    offload_optimizer: bool
    micro_batch: int
    grad_accum: int
    reduce_bucket_size: int | None = None
    """None: the user's own (the dimension is not searched)."""
    offload_param: bool = False
    """Stage 3 with the optimizer offloaded: the parameters offloaded to the CPU too (ZeRO-Infinity's CPU case)."""
    activation_checkpointing: bool | None = None
    """True: the user's `activation_checkpointing` section is kept; False: it is dropped; None: not searched
    (the config has no such section)."""

    @property
    def name(self) -> str:
        bucket = "" if self.reduce_bucket_size is None else f"_rbs{self.reduce_bucket_size:.0e}".replace("+", "")
        offload = ("_offload" if self.offload_optimizer else "") + ("_params" if self.offload_param else "")
        checkpointing = {None: "", True: "_ac", False: "_noac"}[self.activation_checkpointing]
        return f"z{self.stage}{offload}_mbs{self.micro_batch}_gas{self.grad_accum}{bucket}{checkpointing}"


def micro_batch_sizes(plan: AutotuningPlan) -> list[int]:
    """Powers of two between the smallest and largest micro batch, both ends included."""
    low, high = plan.min_micro_batch_size, plan.max_micro_batch_size
    if low > high:
        raise ValueError(
            f"autotuning.min_train_micro_batch_size_per_gpu={low} is above max_train_micro_batch_size_per_gpu={high}; "
            "lower the first or raise the second"
        )
    sizes = {low, high}
    power = 1
    while power <= high:
        if power >= low:
            sizes.add(power)
        power *= 2
    return sorted(sizes)


def _accumulation(user: dict[str, object], micro: int, world: int, plan: AutotuningPlan) -> int | None:
    """The gradient accumulation for `micro` on `world` ranks, or None when the batch rules exclude it."""
    fixed = user.get("train_batch_size")
    if isinstance(fixed, int) and not isinstance(fixed, bool):
        return fixed // (micro * world) if fixed % (micro * world) == 0 else None
    accum = user.get("gradient_accumulation_steps")
    accum = accum if isinstance(accum, int) and not isinstance(accum, bool) and accum > 0 else 1
    if plan.max_train_batch_size is not None and micro * accum * world > plan.max_train_batch_size:
        return None
    return accum


def zero_stages(user: dict[str, object]) -> tuple[int, ...]:
    """The ZeRO stages to search, as DeepSpeed's tuner reads `zero_optimization.stage`: a stage searches that
    stage only, a list those stages, "all" (or no stage: here DeepSpeed would search stage 0 only) all four."""
    zero = user.get("zero_optimization")
    stage = zero.get("stage", "all") if isinstance(zero, dict) else "all"
    stages = stage if isinstance(stage, list) else [stage]
    if "all" in stages:
        return (0, 1, 2, 3)
    if not stages or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= 3 for s in stages):
        raise ValueError(
            f'zero_optimization.stage={stage!r}: the tuner searches a stage 0-3, a list of them or "all"; '
            "write one of those"
        )
    return tuple(sorted(set(stages)))


def grid(plan: AutotuningPlan, user: dict[str, object], *, world: int) -> list[Candidate]:
    """Every candidate of the space for `world` data-parallel ranks (stage 0 has no optimizer offload)."""
    buckets: tuple[int | None, ...] = (None,) if plan.fast else BUCKET_SIZES
    checkpointing: tuple[bool | None, ...] = (False, True) if "activation_checkpointing" in user else (None,)
    found = []
    for stage in zero_stages(user):
        for offload, params in OFFLOADS[stage]:
            for micro in micro_batch_sizes(plan):
                accum = _accumulation(user, micro, world, plan)
                if accum is None:
                    continue
                base = Candidate(
                    stage=stage, offload_optimizer=offload, offload_param=params, micro_batch=micro, grad_accum=accum
                )
                found += [
                    dataclasses.replace(base, reduce_bucket_size=bucket, activation_checkpointing=recompute)
                    for bucket in buckets
                    for recompute in checkpointing
                ]
    return found


def tunable_config(user: dict[str, object]) -> dict[str, object]:
    """The user's config without a searched stage ("all" or a list), so that it resolves as a config."""
    zero = user.get("zero_optimization")
    if not isinstance(zero, dict) or isinstance(zero.get("stage", 0), int):
        return user
    return {**user, "zero_optimization": {k: v for k, v in zero.items() if k != "stage"}}


def candidate_config(user: dict[str, object], candidate: Candidate, *, world: int) -> dict[str, object]:
    """The user's config (its `autotuning` section dropped) with the candidate's batch and ZeRO keys."""
    config = copy.deepcopy(user)
    config.pop("autotuning", None)
    config["train_micro_batch_size_per_gpu"] = candidate.micro_batch
    config["gradient_accumulation_steps"] = candidate.grad_accum
    config["train_batch_size"] = candidate.micro_batch * candidate.grad_accum * world
    zero = config.get("zero_optimization")
    zero = dict(zero) if isinstance(zero, dict) else {}
    zero["stage"] = candidate.stage
    zero.pop("offload_optimizer", None)
    zero.pop("offload_param", None)
    if candidate.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    if candidate.offload_param:
        zero["offload_param"] = {"device": "cpu"}
    if candidate.reduce_bucket_size is not None:
        zero["reduce_bucket_size"] = candidate.reduce_bucket_size
    config["zero_optimization"] = zero
    if candidate.activation_checkpointing is False:
        config.pop("activation_checkpointing", None)
    return config


def trial_config(
    user: dict[str, object], candidate: Candidate, *, world: int, plan: AutotuningPlan, metric_path: str
) -> dict[str, object]:
    """A trial's config: the candidate's, profiled (`autotuning.enabled`) into `metric_path`."""
    config = candidate_config(user, candidate, world=world)
    config["autotuning"] = {
        "enabled": True,
        "metric_path": metric_path,
        "start_profile_step": plan.start_profile_step,
        "end_profile_step": plan.end_profile_step,
    }
    return config


def optimal_config(config: dict[str, object]) -> str:
    """The JSON text of a chosen config (what ds_config_optimal.json holds)."""
    return json.dumps(config, indent=2, sort_keys=True) + "\n"

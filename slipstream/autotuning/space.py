"""The search space: one `Candidate` per ZeRO stage x offload x micro batch (x reduce bucket size, and at stage 3
prefetch bucket size and sub-group size, when `autotuning.fast` is false; x activation checkpointing on/off when
the config has an `activation_checkpointing` section), the gradient accumulation that keeps `train_batch_size`
when the config fixes it, and the DeepSpeed config of each candidate (the user's config with the candidate's keys
written over it). The batch arithmetic counts data-parallel ranks: the world over `autotuning.mp_size`.

Offloads: none, the optimizer to the CPU (stages 1-3); at stage 3 also the parameters alone, and the optimizer
with the parameters, to the CPU; and when the user's config names an `nvme_path` (in `offload_optimizer` or
`offload_param`, or given as `--autotuning_nvme_path`), at stage 3 the optimizer, and the optimizer with the
parameters, to NVMe at that path.

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
    "PREFETCH_SIZES",
    "SUB_GROUP_SIZES",
    "data_parallel",
    "nvme_path",
    "with_nvme_path",
    "Candidate",
    "candidate_config",
    "grid",
    "micro_batch_sizes",
    "optimal_config",
    "tunable_config",
    "zero_stages",
]

OFFLOADS = {0: ((False, False),), 1: ((False, False), (True, False)), 2: ((False, False), (True, False))}
OFFLOADS[3] = (*OFFLOADS[2], (False, True), (True, True))
"""Per stage, the (optimizer, parameter) offloads to the CPU searched."""
NVME_OFFLOADS = ((True, False), (True, True))
"""The (optimizer, parameter) offloads to NVMe searched at stage 3 when the config names an nvme_path."""
BUCKET_SIZES = (50_000_000, 500_000_000, 1_000_000_000)
"""Reduce bucket sizes tried when `autotuning.fast` is false (DeepSpeed's tuning space for stages 1-3)."""
PREFETCH_SIZES = (50_000_000, 500_000_000)
"""`stage3_prefetch_bucket_size` values tried at stage 3 when `autotuning.fast` is false."""
SUB_GROUP_SIZES = (100_000_000, 1_000_000_000)
"""`sub_group_size` values tried at stage 3 when `autotuning.fast` is false."""


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
    offload_device: str = "cpu"
    """Where the offloads that are on go: "cpu" or "nvme" (the user's nvme_path)."""
    prefetch_bucket_size: int | None = None
    """`stage3_prefetch_bucket_size` (None: the user's own)."""
    sub_group_size: int | None = None
    """`sub_group_size` (None: the user's own)."""

    @property
    def name(self) -> str:
        sizes = (("_rbs", self.reduce_bucket_size), ("_pf", self.prefetch_bucket_size), ("_sg", self.sub_group_size))
        tail = "".join("" if v is None else f"{key}{v:.0e}".replace("+", "") for key, v in sizes)
        offload = ("_offload" if self.offload_optimizer else "") + ("_params" if self.offload_param else "")
        offload += "_nvme" if offload and self.offload_device == "nvme" else ""
        checkpointing = {None: "", True: "_ac", False: "_noac"}[self.activation_checkpointing]
        return f"z{self.stage}{offload}_mbs{self.micro_batch}_gas{self.grad_accum}{tail}{checkpointing}"


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


def _batch_allowed(micro: int, accum: int | None, world: int, plan: AutotuningPlan) -> bool:
    """Whether a (micro batch, accumulation) pair exists and its global batch is at least `min_train_batch_size`."""
    return accum is not None and micro * accum * world >= plan.min_train_batch_size


def data_parallel(world: int, plan: AutotuningPlan) -> int:
    """The data-parallel ranks of `world` ranks: the world over `autotuning.mp_size`."""
    if world % plan.mp_size:
        raise ValueError(
            f"autotuning.mp_size={plan.mp_size} does not divide the {world} ranks of the launch; "
            "set it to the model-parallel size the script uses (a divisor of the world)"
        )
    return world // plan.mp_size


def nvme_path(user: dict[str, object]) -> str | None:
    """The `nvme_path` the user's config names (offload_optimizer's first, then offload_param's), or None."""
    zero = user.get("zero_optimization")
    for key in ("offload_optimizer", "offload_param"):
        section = zero.get(key) if isinstance(zero, dict) else None
        path = section.get("nvme_path") if isinstance(section, dict) else None
        if isinstance(path, str) and path:
            return path
    return None


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


def with_nvme_path(user: dict[str, object], path: str | None) -> dict[str, object]:
    """The user's config with `path` as `offload_optimizer.nvme_path` (`--autotuning_nvme_path`; None: as is):
    the NVMe offloads are then searched there. The offload's device is left as the config sets it."""
    if not path:
        return user
    zero = user.get("zero_optimization")
    zero = dict(zero) if isinstance(zero, dict) else {}
    section = zero.get("offload_optimizer")
    zero["offload_optimizer"] = {**(section if isinstance(section, dict) else {}), "nvme_path": path}
    return {**user, "zero_optimization": zero}


def _offloads(stage: int, user: dict[str, object]) -> list[tuple[bool, bool, str]]:
    """The (optimizer, parameters, device) offloads searched at `stage`."""
    found = [(opt, par, "cpu") for opt, par in OFFLOADS[stage]]
    if stage == 3 and nvme_path(user) is not None:
        found += [(opt, par, "nvme") for opt, par in NVME_OFFLOADS]
    return found


def _sizes(plan: AutotuningPlan, stage: int) -> list[dict[str, int | None]]:
    """The bucket and sub-group sizes searched at `stage` (only the user's own when `fast`)."""
    if plan.fast:
        return [{}]
    stage3 = stage == 3
    return [
        {"reduce_bucket_size": bucket, "prefetch_bucket_size": prefetch, "sub_group_size": group}
        for bucket in BUCKET_SIZES
        for prefetch in (PREFETCH_SIZES if stage3 else (None,))
        for group in (SUB_GROUP_SIZES if stage3 else (None,))
    ]


def grid(plan: AutotuningPlan, user: dict[str, object], *, world: int) -> list[Candidate]:
    """Every candidate of the space for `world` data-parallel ranks (stage 0 has no optimizer offload)."""
    checkpointing: tuple[bool | None, ...] = (False, True) if "activation_checkpointing" in user else (None,)
    found = []
    for stage in zero_stages(user):
        for offload, params, device in _offloads(stage, user):
            for micro in micro_batch_sizes(plan):
                accum = _accumulation(user, micro, world, plan)
                if accum is None or not _batch_allowed(micro, accum, world, plan):
                    continue
                base = Candidate(
                    stage=stage,
                    offload_optimizer=offload,
                    offload_param=params,
                    offload_device=device,
                    micro_batch=micro,
                    grad_accum=accum,
                )
                found += [
                    dataclasses.replace(base, activation_checkpointing=recompute, **sizes)  # type: ignore[arg-type]
                    for sizes in _sizes(plan, stage)
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
    path = nvme_path(user)
    zero.pop("offload_optimizer", None)
    zero.pop("offload_param", None)
    target = {"device": "nvme", "nvme_path": path} if candidate.offload_device == "nvme" else {"device": "cpu"}
    if candidate.offload_optimizer:
        zero["offload_optimizer"] = dict(target)
    if candidate.offload_param:
        zero["offload_param"] = dict(target)
    for key, value in (
        ("reduce_bucket_size", candidate.reduce_bucket_size),
        ("stage3_prefetch_bucket_size", candidate.prefetch_bucket_size),
        ("sub_group_size", candidate.sub_group_size),
    ):
        if value is not None:
            zero[key] = value
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

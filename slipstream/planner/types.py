"""The planner's typed inputs and results: `Option` (one ZeRO configuration), `Settings` (the knobs every option
shares), `OptionEstimate` (bytes per device and per host, by role) and `Plan` (all options, the cheapest that fits).

Pure data: no torch. Byte figures are ints; "per rank" means per data-parallel process (one accelerator).

[Note: planner roles]
Device roles (per rank): `params` (flat parameters at stages 0-2, this rank's shards at stage 3),
`frozen_params` (stages 0-2: parameters without gradients, which the ZeRO optimizer does not own),
`gathered_params` (stage 3: the peak of the gathered units' full buffers, persistent unit included),
`grads`, `master` (fp32 master weights), `optimizer_state`, `comm_buffers` (reduce/gather staging buffers and
the stage-3 gather pool), `transient` (full-size gradients not yet taken by the ZeRO hooks: the largest parameter's at
stages 0-2; at stage 3 those of the units waiting for their turn in the reduce-scatter order). Host roles (per rank): `master`, `optimizer_state`,
`host_buffers` (offload: fp32 gradient copies and the low-precision staging buffer), `offloaded_params`
(stage 3 parameter offload) and `pinned_rounding` (the CUDA pinned allocator rounds every pinned block up to a
power of two). Activations are separate figures, with and without activation checkpointing.
`model_states` sums exactly what `engine.optimizer.owned_bytes()` counts: params (offloaded shards included),
master, grads, optimizer_state, host_buffers, comm_buffers.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from slipstream.config.plan import CpuTarget, NoOffloadTarget, NvmeTarget, OffloadTarget, Stage3Plan
from slipstream.config.precision_plans import AutocastPlan

if TYPE_CHECKING:
    from slipstream.offload.policy import OffloadPolicy

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
OWNED_ROLES = ("params", "master", "grads", "optimizer_state", "host_buffers", "comm_buffers")
DEVICE_ROLES = (
    "params",
    "frozen_params",
    "gathered_params",
    "grads",
    "master",
    "optimizer_state",
    "comm_buffers",
    "transient",
)
HOST_ROLES = ("master", "optimizer_state", "host_buffers", "offloaded_params", "pinned_rounding")


TargetType = type[OffloadTarget]
"""An offload target type of config/plan.py (`OFFLOAD_TARGETS`); its policy class (offload/choose.py `POLICIES`)
says what the target keeps on the host, in files and pinned."""


def offload_policy(target: TargetType) -> type[OffloadPolicy]:
    """The policy class of an offload target type. Imports offload/ (and torch), so it is asked when an option is
    estimated or named, never when the planner is imported."""
    from slipstream.offload.choose import policy_type

    return policy_type(target)


def _legacy_targets(*, offload_optimizer: bool, offload_param: bool, nvme: bool) -> tuple[TargetType, TargetType]:
    """The targets that `Option`'s boolean keywords stand for: host memory, or files with `nvme`."""
    if nvme and not offload_optimizer:
        raise ValueError("Option: nvme needs offload_optimizer (NVMe holds what offload moves off the device)")
    offloaded: TargetType = NvmeTarget if nvme else CpuTarget
    return (offloaded if offload_optimizer else NoOffloadTarget), (offloaded if offload_param else NoOffloadTarget)


@dataclasses.dataclass(frozen=True, slots=True, init=False)
class Option:
    """One ZeRO configuration to evaluate: a stage and where the optimizer's and the parameters' offloaded
    tensors go, as offload target types. `Option(stage=3, offload_optimizer=True, offload_param=True, nvme=True)`
    is accepted too and stands for `CpuTarget` (`NvmeTarget` with `nvme`) on the sections it names."""

    stage: int
    optimizer_target: TargetType
    """zero_optimization.offload_optimizer's target (`NoOffloadTarget`: no optimizer offload)."""
    param_target: TargetType
    """zero_optimization.offload_param's target (stage 3 only)."""
    label: str
    """Shown instead of the generated name (e.g. "config" for the row of a given DeepSpeed config)."""

    def __init__(
        self,
        *,
        stage: int,
        optimizer_target: TargetType | None = None,
        param_target: TargetType | None = None,
        label: str = "",
        offload_optimizer: bool = False,
        offload_param: bool = False,
        nvme: bool = False,
    ) -> None:
        legacy = _legacy_targets(offload_optimizer=offload_optimizer, offload_param=offload_param, nvme=nvme)
        if (optimizer_target or param_target) and (offload_optimizer or offload_param or nvme):
            raise ValueError(
                "Option: give the offload targets (optimizer_target, param_target) or the booleans "
                "(offload_optimizer, offload_param, nvme), not both"
            )
        object.__setattr__(self, "stage", stage)
        object.__setattr__(self, "optimizer_target", optimizer_target or legacy[0])
        object.__setattr__(self, "param_target", param_target or legacy[1])
        object.__setattr__(self, "label", label)
        self._check()

    def _check(self) -> None:
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"Option.stage must be 0, 1, 2 or 3, got {self.stage}")
        for key in ("optimizer_target", "param_target"):
            target = getattr(self, key)
            if not (isinstance(target, type) and issubclass(target, OffloadTarget)):
                raise TypeError(
                    f"Option.{key} must be an offload target type of slipstream.config.plan.OFFLOAD_TARGETS "
                    f"(e.g. CpuTarget), got {target!r}"
                )
        if self.param_target.kind != NoOffloadTarget.kind and self.stage != 3:
            raise ValueError(
                f"Option: offload_param needs stage 3 (got stage {self.stage}); "
                "zero_optimization.offload_param has no effect below stage 3"
            )

    @property
    def offload_optimizer(self) -> bool:
        """The optimizer step runs on the host (its policy's `on_host`)."""
        return offload_policy(self.optimizer_target).on_host

    @property
    def offload_param(self) -> bool:
        """Stage 3's parameter shards are offloaded (their policy's `on_host`)."""
        return offload_policy(self.param_target).on_host

    @property
    def in_files(self) -> bool:
        """The optimizer's offloaded tensors live in files (its policy's `in_files`); the planner moves what the
        option offloads, parameter shards included, to the disk."""
        return offload_policy(self.optimizer_target).in_files

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        parts = [f"zero{self.stage}"]
        if self.offload_optimizer:
            parts.append("offload_optimizer")
        if self.offload_param:
            parts.append("offload_param")
        return "+".join(parts) + (f"({self.optimizer_target.kind})" if self.in_files else "")

    @property
    def cost_rank(self) -> tuple[int, int, int, int]:
        """Lower is cheaper to run: no offload before optimizer offload before parameter offload, then the
        lower stage (less communication); an option whose tensors live in files comes last."""
        return (int(self.in_files), int(self.offload_param), int(self.offload_optimizer), self.stage)


STANDARD_OPTIONS = (
    *(Option(stage=stage) for stage in range(4)),
    *(Option(stage=stage, optimizer_target=CpuTarget) for stage in range(4)),
    Option(stage=3, optimizer_target=CpuTarget, param_target=CpuTarget),
    Option(stage=3, optimizer_target=NvmeTarget, param_target=NvmeTarget),
)
"""The rows of `slipstream plan`: stages 0-3 with and without optimizer offload, and stage 3 with parameter
offload."""


def _schema_bucket_size() -> int:
    from slipstream.config.schema.zero import ZeroConfig

    return int(ZeroConfig().reduce_bucket_size)


def _schema_stage3() -> Stage3Plan:
    from slipstream.config.resolve import default_stage3_plan

    return default_stage3_plan()


def _accelerator_is_host() -> bool:
    from slipstream.accelerator import get_accelerator

    return get_accelerator().device_name() == "cpu"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Settings:
    """Knobs shared by every option: the config schema's defaults unless a config says otherwise. Stage-3
    knobs are the engine's own `Stage3Plan` (config/plan.py), so the planner reads what ZeroModel reads."""

    dtype: str = "bf16"
    """Parameter dtype: "fp32", "bf16" or "fp16"."""
    grad_accum_dtype: str = "fp32"
    master_dtype: str = "fp32"
    reduce_dtype: str | None = None
    """The ZeRO reduce dtype (communication_data_type); None: the grad-accumulation dtype."""
    autocast: AutocastPlan | None = None
    """torch_autocast (the plan's): its safe modules' gradients are reduced in its dtype ([Note: reduction
    buffers by dtype] in reduce_buffers.py)."""
    overlap_comm: bool = True
    """zero_optimization.overlap_comm (two reductions in flight at once, or one)."""
    optimizer_state_dtype: str | None = None
    """The optimizer moments' dtype (the plan's); None: the master dtype's."""
    reduce_bucket_size: int = dataclasses.field(default_factory=_schema_bucket_size)
    stage3: Stage3Plan = dataclasses.field(default_factory=_schema_stage3)
    pin_memory: bool = True
    optimizer: str = "adamw"
    """Optimizer name as the config spells it (config/optimizers.py counts its state tensors per element)."""
    optimizer_params: tuple[tuple[str, Any], ...] = ()
    """Optimizer keyword arguments that change its state (momentum, amsgrad, centered), as sorted pairs."""
    zero_init: bool = True
    """Stage 3 models are built under zero.Init (the host never holds the whole model)."""
    device_is_host: bool = dataclasses.field(default_factory=_accelerator_is_host)
    """The accelerator is the CPU: with offload, fp32 gradients are already host memory and get no host copy."""

    @property
    def comm_dtype(self) -> str:
        """The dtype gradients are reduced in outside the safe modules."""
        return self.reduce_dtype or self.grad_accum_dtype

    def __post_init__(self) -> None:
        for key in ("dtype", "grad_accum_dtype", "master_dtype", "reduce_dtype"):
            if getattr(self, key) not in DTYPE_BYTES and (key != "reduce_dtype" or self.reduce_dtype is not None):
                raise ValueError(f"Settings.{key} must be one of {sorted(DTYPE_BYTES)}, got {getattr(self, key)!r}")
        if self.reduce_bucket_size < 1:
            raise ValueError(
                f"zero_optimization.reduce_bucket_size must be >= 1 element, got {self.reduce_bucket_size}"
            )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class OptionEstimate:
    """Bytes one option needs (see [Note: planner roles])."""

    option: Option
    device: dict[str, int]
    """Per rank, by role (activations excluded)."""
    host: dict[str, int]
    """Per rank, by role."""
    activations: int | None
    """Per rank, without activation checkpointing; None when the model's shape is unknown."""
    activations_checkpointed: int | None
    host_init_per_rank: int
    """Host bytes while the model is built, before the engine (a full fp32 copy unless zero.Init at stage 3)."""
    model_states: int
    """Per rank: what `engine.optimizer.owned_bytes()` sums to (see [Note: planner roles])."""
    owned: dict[str, int]
    """Per rank, in the keys of `owned_bytes()` (offloaded_params included at stage 3)."""
    gpus_per_node: int
    nvme_per_rank: int = 0
    """Bytes in files under nvme_path per rank (masters, optimizer states, and parameter shards with
    offload_param). At stage 3 the host keeps two sub-groups' masters and states (docs/offload.md)."""
    fits_device: bool | None = None
    fits_device_checkpointed: bool | None = None
    fits_host: bool | None = None

    @property
    def device_total(self) -> int:
        """Per rank, activations without checkpointing included (0 when unknown)."""
        return sum(self.device.values()) + (self.activations or 0)

    @property
    def device_total_checkpointed(self) -> int:
        return sum(self.device.values()) + (self.activations_checkpointed or 0)

    @property
    def host_total(self) -> int:
        """Per node: every local rank's host roles, or the model build when that is larger."""
        return self.gpus_per_node * max(sum(self.host.values()), self.host_init_per_rank)

    def to_dict(self) -> dict[str, Any]:
        return {
            "option": self.option.name,
            "stage": self.option.stage,
            "offload_optimizer": self.option.offload_optimizer,
            "offload_param": self.option.offload_param,
            "nvme": self.option.in_files,
            "nvme_bytes_per_rank": self.nvme_per_rank,
            "device_bytes": dict(self.device),
            "host_bytes_per_rank": dict(self.host),
            "activations": self.activations,
            "activations_checkpointed": self.activations_checkpointed,
            "device_total": self.device_total,
            "device_total_checkpointed": self.device_total_checkpointed,
            "host_init_per_rank": self.host_init_per_rank,
            "host_total_per_node": self.host_total,
            "model_states": self.model_states,
            "owned_bytes": dict(self.owned),
            "fits_device": self.fits_device,
            "fits_device_checkpointed": self.fits_device_checkpointed,
            "fits_host": self.fits_host,
        }


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """The planner's answer: one estimate per option, and the cheapest option that fits."""

    total_params: int
    trainable_params: int
    world_size: int
    gpus_per_node: int
    nodes: int
    settings: Settings
    estimates: tuple[OptionEstimate, ...]
    device_memory: int | None = None
    host_memory: int | None = None
    cheapest: str | None = None
    """Name of the cheapest option that fits (see `Option.cost_rank`), or None."""
    cheapest_needs_checkpointing: bool = False
    notes: tuple[str, ...] = ()

    def estimate_for(self, name: str) -> OptionEstimate:
        for estimate in self.estimates:
            if estimate.option.name == name:
                return estimate
        raise KeyError(f"no option named {name!r}; the plan has {[e.option.name for e in self.estimates]}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "total_params": self.total_params,
            "trainable_params": self.trainable_params,
            "world_size": self.world_size,
            "gpus_per_node": self.gpus_per_node,
            "nodes": self.nodes,
            "settings": dataclasses.asdict(self.settings),
            "device_memory": self.device_memory,
            "host_memory": self.host_memory,
            "cheapest": self.cheapest,
            "cheapest_needs_checkpointing": self.cheapest_needs_checkpointing,
            "notes": list(self.notes),
            "options": [e.to_dict() for e in self.estimates],
        }

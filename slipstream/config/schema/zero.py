"""The `zero_optimization` section: ZeRO stage, buckets, offload, stage-3 knobs, ZenFlow.

Defaults are DeepSpeed 0.19's (`runtime/zero/config.py`, `runtime/zero/offload_config.py`). Legacy forms are
converted before validation: `"zero_optimization": true` is stage 1 (false is stage 0), the deprecated
`cpu_offload`, `cpu_offload_param` and `cpu_offload_use_pin_memory` become offload sections.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from slipstream.config.errors import ConfigWarning
from slipstream.config.schema.base import DSBool, DSFloat, DSInt, DSModel, aliased, zero_one
from slipstream.utils.logging import get_logger

__all__ = [
    "DEFAULT_LEAF_MODULE_CLASSES",
    "DEFAULT_LEAF_MODULE_NAMES",
    "DEFAULT_LEAF_MODULE_NAME_SUFFIXES",
    "LeafModuleConfig",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OffloadSection",
    "ZenFlowConfig",
    "ZeroConfig",
]

OffloadDevice = Literal["none", "cpu", "nvme"]


def _offload_keys(plan: str) -> dict[str, str]:
    """The `IMPLEMENTED` map of an offload section whose target is the plan field `plan`."""
    return {"device": plan, "nvme_path": f"{plan}.path", "pin_memory": f"{plan}.pin_memory"}


class OffloadSection(DSModel):
    """What `offload_optimizer` and `offload_param` share: where the tensors go and the NVMe buffer pool."""

    device: OffloadDevice = "none"
    """Where the offloaded tensors live: "none", "cpu" or "nvme"."""
    nvme_path: str | None = None
    """Directory for NVMe offload."""
    buffer_count: DSInt = Field(4, ge=0)
    """Number of buffers in the offload buffer pool."""


class OffloadOptimizerConfig(OffloadSection):
    """`zero_optimization.offload_optimizer` (stages 1-3): optimizer state."""

    IMPLEMENTED = _offload_keys("zero.offload_optimizer")
    pin_memory: DSBool = True
    """Use page-locked host memory for offloaded state."""
    pipeline_read: DSBool = False
    """Overlap NVMe reads with compute."""
    pipeline_write: DSBool = False
    """Overlap NVMe writes with compute."""
    fast_init: DSBool = False
    """Faster optimizer initialisation when offloading to NVMe."""
    ratio: DSFloat = Field(1.0, ge=0.0, le=1.0)
    """Fraction of the optimizer step run on CPU (values below 1 only with stage 3)."""
    super_offload: DSBool = False
    """DeepSpeed SuperOffload (stage 3)."""
    cpuadam_cores_perc: DSFloat = Field(0.8, gt=0.0, le=1.0)
    """Share of host cores used by the CPU Adam."""

    @property
    def pipeline(self) -> bool:
        """True when NVMe reads or writes are overlapped (DeepSpeed's derived `pipeline` field)."""
        return bool(self.pipeline_read or self.pipeline_write)


class OffloadParamConfig(OffloadSection):
    """`zero_optimization.offload_param` (stage 3 only): parameters between uses; parsed into
    Stage3Plan.offload_param."""

    IMPLEMENTED = _offload_keys("zero.stage3.offload_param")
    buffer_count: DSInt = Field(5, ge=0)
    """Number of parameter buffers."""
    buffer_size: DSInt = Field(100_000_000, ge=0)
    """Size of each parameter buffer, in elements."""
    max_in_cpu: DSInt = Field(1_000_000_000, ge=0)
    """Elements kept in host memory when offloading to NVMe."""
    pin_memory: DSBool = True
    """Use page-locked host memory."""


DEFAULT_LEAF_MODULE_CLASSES: list[str] = [
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
]
"""DeepSpeed 0.19's default leaf classes: Hugging Face's sparse MoE blocks (their experts run in a
data-dependent order, so each block is gathered whole)."""
DEFAULT_LEAF_MODULE_NAMES: list[str] = []
DEFAULT_LEAF_MODULE_NAME_SUFFIXES: list[str] = []


class LeafModuleConfig(DSModel):
    """`zero_optimization.leaf_module`: the modules stage 3 gathers whole and never splits
    (`DeepSpeedZeroLeafModuleConfig`). A single string is read as a one-element list; repeats are dropped."""

    IMPLEMENTED = {
        "classes": "zero.stage3.leaf_classes",
        "names": "zero.stage3.leaf_names",
        "name_suffixes": "zero.stage3.leaf_suffixes",
    }
    classes: list[str] = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_CLASSES))
    """Classes, by name (`MixtralSparseMoeBlock`) or fully qualified (`package.module.Class`)."""
    names: list[str] = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_NAMES))
    """Qualified module names, as `model.named_modules()` gives them."""
    name_suffixes: list[str] = Field(default_factory=lambda: list(DEFAULT_LEAF_MODULE_NAME_SUFFIXES))
    """Every module whose qualified name ends with one of these."""

    @model_validator(mode="before")
    @classmethod
    def _lists(cls, data: object) -> Any:
        if data is None:
            return {}
        if not isinstance(data, dict):
            raise ValueError(f'leaf_module must be a mapping like {{"classes": [...], "names": [...]}}, got {data!r}')
        data = dict(data)
        for key in ("classes", "names", "name_suffixes"):
            value = data.get(key)
            if isinstance(value, str):
                data[key] = [value]
            elif isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
                data[key] = list(dict.fromkeys(value))
        return data


class ZenFlowConfig(DSModel):
    """`zero_optimization.zenflow` (`runtime/zenflow/zenflow_config.py`)."""

    IMPLEMENTED = {
        "topk_ratio": "zero.zenflow.topk_ratio",
        "select_strategy": "zero.zenflow.select_per_epoch",
        "select_interval": "zero.zenflow.select_every",
        "update_interval": "zero.zenflow.update_interval",
        "overlap_step": "zero.zenflow.overlap_step",
        "offload": "zero.zenflow.offload",
        "full_warm_up_rounds": "zero.zenflow.full_warm_up_rounds",
    }
    LITERAL_AUTO = frozenset({"select_strategy", "select_interval", "update_interval"})
    topk_ratio: DSFloat = Field(0.1, ge=0.0, le=1.0)
    """Fraction of gradient columns updated on the GPU each step."""
    select_strategy: str = "auto"
    """How important columns are chosen: "auto", "step" or "epoch"."""
    select_interval: Literal["auto"] | DSInt = "auto"
    """Steps between re-selection, or "auto"."""
    update_interval: Literal["auto"] | DSInt = "auto"
    """Steps between CPU updates, or "auto"."""
    overlap_step: DSBool = False
    """Overlap the CPU step with GPU compute."""
    offload: DSBool = False
    """Offload ZenFlow state."""
    auto_ratio: DSFloat = Field(0.99, ge=0.0, le=1.0)
    """Threshold used by the "auto" strategy."""
    full_warm_up_rounds: DSInt = Field(0, ge=0)
    """Steps of full updates before selective updates begin."""
    pt_reserved_cores_perc: DSFloat = Field(0.5, ge=0.0, le=1.0)
    """Share of host cores reserved for PyTorch."""
    steps_per_epoch: DSInt | None = None
    """Steps per epoch, for the "epoch" strategy."""


class ZeroConfig(DSModel):
    """`zero_optimization` (`DeepSpeedZeroConfig`)."""

    IMPLEMENTED = {
        "stage": "zero.stage",
        "reduce_bucket_size": "zero.reduce_bucket_size",
        "offload_param": "zero.stage3.offload_param",
        "offload_optimizer": "zero.offload_optimizer",
        "cpu_offload": "zero.offload_optimizer",
        "cpu_offload_param": "zero.stage3.offload_param",
        "cpu_offload_use_pin_memory": "zero.offload_optimizer.pin_memory",
        "prefetch_bucket_size": "zero.stage3.prefetch_numel",
        "param_persistence_threshold": "zero.stage3.persistence_threshold",
        "max_live_parameters": "zero.stage3.max_live_numel",
        "max_reuse_distance": "zero.stage3.reuse_distance",
        "gather_16bit_weights_on_model_save": "zero.stage3.gather_16bit_on_save",
        "leaf_module": "zero.stage3.leaf_classes",
        "sub_group_size": "zero.stage3.sub_group_numel",
        "overlap_comm": "zero.overlap_comm",
        "zero_quantized_weights": "zero.stage3.quantized_weights",
        "zero_quantized_nontrainable_weights": "zero.stage3.quantized_frozen_weights",
        "zero_hpz_partition_size": "zero.stage3.secondary_shard_size",
        "mics_shard_size": "zero.stage3.shard_size",
        "zero_quantized_gradients": "zero.stage3.quantized_gradients",
        "zeropp_loco_param": "zero.stage3.loco",
        "mics_hierarchical_params_gather": "zero.stage3.hierarchical_gather",
    }
    stage: DSInt = Field(0, ge=0, le=3)
    """0 disabled, 1 optimizer state, 2 + gradients, 3 + parameters are partitioned."""
    contiguous_gradients: DSBool = True
    """Copy gradients into one contiguous buffer as they are produced."""
    reduce_scatter: DSBool = True
    """Average gradients with reduce-scatter instead of all-reduce (stages 1-2)."""
    reduce_bucket_size: DSInt = Field(500_000_000, ge=0)
    """Elements reduced at a time."""
    use_multi_rank_bucket_allreduce: DSBool = True
    """Combine reduction buckets of several ranks into one all-reduce."""
    allgather_partitions: DSBool = True
    """All-gather updated partitions (true) or broadcast them (false) after the step."""
    allgather_bucket_size: DSInt = Field(500_000_000, ge=0)
    """Elements all-gathered at a time."""
    overlap_comm: DSBool | None = None
    """Overlap gradient reduction with backward (stages 1-3); None means true for stage 3, false otherwise."""
    load_from_fp32_weights: DSBool = True
    """Initialise fp32 master weights from the checkpoint's fp32 copy."""
    elastic_checkpoint: DSBool = False
    """Load optimizer state saved with a different data-parallel size (legacy)."""
    offload_param: OffloadParamConfig | None = None
    """Parameter offload (stage 3)."""
    offload_optimizer: OffloadOptimizerConfig | None = None
    """Optimizer-state offload (stages 1-3)."""
    zenflow: ZenFlowConfig | None = None
    """ZenFlow stall-free offload."""
    sub_group_size: DSInt = Field(1_000_000_000, ge=0)
    """Elements per optimizer sub-group (stage 3): the optimizer steps, and with NVMe offload swaps, one
    sub-group at a time, so it bounds the host memory of the step. 0 makes each parameter a sub-group of its own
    (as DeepSpeed's `_create_fp16_sub_groups` does)."""
    cpu_offload: DSBool | None = None
    """Deprecated: true means offload_optimizer.device = "cpu"."""
    cpu_offload_param: DSBool | None = None
    """Deprecated: true means offload_param.device = "cpu"."""
    cpu_offload_use_pin_memory: DSBool | None = None
    """Deprecated: pin_memory of the offload sections."""
    prefetch_bucket_size: DSInt = aliased(50_000_000, "stage3_prefetch_bucket_size", "prefetch_bucket_size", ge=0)
    """Elements of parameters prefetched ahead of use (stage 3)."""
    param_persistence_threshold: DSInt = aliased(
        100_000, "stage3_param_persistence_threshold", "param_persistence_threshold", ge=0
    )
    """Parameters smaller than this stay unpartitioned (stage 3)."""
    model_persistence_threshold: DSInt = aliased(
        sys.maxsize, "stage3_model_persistence_threshold", "model_persistence_threshold", ge=0
    )
    """Upper bound on elements kept unpartitioned by the persistence threshold (stage 3)."""
    max_live_parameters: DSInt = aliased(1_000_000_000, "stage3_max_live_parameters", "max_live_parameters", ge=0)
    """Most gathered parameter elements alive at once (stage 3)."""
    max_reuse_distance: DSInt = aliased(1_000_000_000, "stage3_max_reuse_distance", "max_reuse_distance", ge=0)
    """Keep a gathered parameter if it is reused within this many elements (stage 3)."""
    gather_16bit_weights_on_model_save: DSBool = aliased(
        False,
        "stage3_gather_16bit_weights_on_model_save",
        "gather_16bit_weights_on_model_save",
        "stage3_gather_fp16_weights_on_model_save",
    )
    """Gather the full 16-bit weights on save_16bit_model (stage 3)."""
    module_granularity_threshold: DSInt = aliased(
        0, "stage3_module_granularity_threshold", "module_granularity_threshold", ge=0
    )
    """Treat modules below this size as leaves when fetching (stage 3)."""
    use_all_reduce_for_fetch_params: DSBool = aliased(
        False, "stage3_use_all_reduce_for_fetch_params", "use_all_reduce_for_fetch_params"
    )
    """Fetch parameters with all-reduce instead of all-gather (stage 3)."""
    allgather_sequential: DSBool = aliased(False, "stage3_allgather_sequential", "allgather_sequential")
    """Issue parameter all-gathers one at a time (stage 3)."""
    ignore_unused_parameters: DSBool = True
    """Tolerate parameters that get no gradient."""
    legacy_stage1: DSBool = False
    """The removed legacy stage-1 implementation; true is an error."""
    round_robin_gradients: DSBool = False
    """Round-robin gradient copying across ranks (stages 1-2 with offload)."""
    zero_hpz_partition_size: DSInt = Field(1, ge=1)
    """ZeRO++ hpZ (stage 3): ranks per block (a node) of the secondary shard each unit keeps after its forward
    gather; the gathers until the next step are all-gathers inside the block. 1: none."""
    zero_quantized_weights: DSBool = False
    """ZeRO++ qwZ (stage 3): the forward and backward all-gathers of parameters travel as block-wise int8."""
    zero_quantized_nontrainable_weights: DSBool = False
    """The same for units whose parameters are all frozen (stage 3); their shards stay in their dtype here."""
    zero_quantized_gradients: DSBool = False
    """ZeRO++ qgZ (stage 3): each unit's gradient reduce-scatter travels as block-wise int4 all-to-alls inside a
    node and int8 across nodes, summed in fp32 in between."""
    zeropp_loco_param: dict[str, Any] | None = None
    """ZeRO++ LoCo (stage 3, with zero_quantized_gradients): {"err_beta": b, "reset_T": T}; each qgZ
    quantization adds the error kept for its buffer first, and keeps err <- b err + (1 - b) (compensated -
    dequantized); the kept errors go back to zero every T reductions of a unit."""
    mics_shard_size: DSInt = -1
    """MiCS (stage 3): ranks per shard group; parameters, gradients and optimizer states are sharded inside each
    group of this many consecutive ranks and replicated across groups. -1 (or 0) disables MiCS."""
    mics_hierarchical_params_gather: DSBool = False
    """MiCS hierarchical all-gather (stage 3, with mics_shard_size spanning nodes): a unit's gather runs across
    nodes among the ranks at the same local rank first, then inside each node."""
    memory_efficient_linear: DSBool = True
    """Memory-efficient linear layer under zero.Init."""
    pipeline_loading_checkpoint: DSBool = False
    """Load checkpoint weights during zero.Init."""
    override_module_apply: DSBool = True
    """Gather parameters around nn.Module.apply under zero.Init."""
    log_trace_cache_warnings: DSBool = False
    """Log stage-3 trace cache invalidations."""
    enable_sanity_checks: DSBool = False
    """Extra stage-3 consistency checks."""
    save_muon_momentum_buffer_in_memory: DSBool = False
    """Keep Muon momentum in memory (stage 3)."""
    leaf_module: LeafModuleConfig = Field(default_factory=LeafModuleConfig)
    """Modules stage 3 gathers whole: {"classes": [...], "names": [...], "name_suffixes": [...]}."""

    @model_validator(mode="before")
    @classmethod
    def _legacy_forms(cls, data: object) -> Any:
        if isinstance(data, bool):
            return {"stage": 1 if data else 0}
        if not isinstance(data, dict):
            return data
        data = dict(data)
        pin = zero_one(data.pop("cpu_offload_use_pin_memory", None))
        if pin is not None and not isinstance(pin, bool):
            raise ValueError(f"cpu_offload_use_pin_memory: expected a boolean (true or false), got {pin!r}")
        for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
            flag = zero_one(data.pop(old, None))
            if flag is None:
                continue
            if not isinstance(flag, bool):
                raise ValueError(f"{old}: expected a boolean (true or false), got {flag!r}")
            if data.get(new) is not None:
                raise ValueError(f"give either the deprecated '{old}' or '{new}', not both; keep '{new}'")
            warnings.warn(
                f'zero_optimization.{old} is deprecated; use "{new}": {{"device": "cpu"}}',
                ConfigWarning,
                stacklevel=2,
            )
            if flag:
                data[new] = {"device": "cpu", **({"pin_memory": pin} if isinstance(pin, bool) else {})}
        return data

    @field_validator("allgather_bucket_size")
    @classmethod
    def _allgather_alignment(cls, value: int, info: ValidationInfo) -> int:
        """DeepSpeed's stage 1-2 optimizer asserts the all-gather bucket holds whole 4-byte units of fp16
        (its `nccl_start_alignment_factor`, 2 elements); a config it refuses is refused here too."""
        if info.data.get("stage") in (1, 2) and value % 2:
            raise ValueError(
                f"allgather_bucket_size must be a multiple of nccl_start_alignment_factor (2) at stages 1 and 2 "
                f"(DeepSpeed asserts it); got {value}, use {value + 1}"
            )
        return value

    @field_validator("legacy_stage1")
    @classmethod
    def _no_legacy_stage1(cls, value: bool) -> bool:
        if value:
            raise ValueError("legacy_stage1 was removed from DeepSpeed; delete the key")
        return value

    @model_validator(mode="after")
    def _elastic_checkpoint_at_stage3(self) -> ZeroConfig:
        """DeepSpeed logs that elastic checkpointing is deprecated for ZeRO-3 (through its logger, where its
        callers look for it); Slipstream's checkpoints load at any world size and stage without the key."""
        if self.stage == 3 and self.elastic_checkpoint:
            get_logger().warning(
                "zero_optimization.elastic_checkpoint: elastic checkpointing is deprecated for ZeRO-3 and has no "
                "effect; Slipstream checkpoints load at any world size and ZeRO stage without it (remove the key)"
            )
        return self

    @model_validator(mode="after")
    def _overlap_comm_default(self) -> ZeroConfig:
        """overlap_comm left unset is true at stages 2 and 3, false below. DeepSpeed fills it true only at stage
        3; at stage 2 overlapping costs no memory here (the staging ring is the same size either way) and moves
        the same values, so the fast schedule is the default. Stage 1's overlap refuses a second backward
        before the step, so it stays opt-in, as in DeepSpeed. Filled without marking it as set, so an unset key
        is never reported."""
        if self.overlap_comm is None:
            object.__setattr__(self, "overlap_comm", self.stage >= 2)
        return self

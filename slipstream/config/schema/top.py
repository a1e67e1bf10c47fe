"""The top level of a DeepSpeed JSON config: batch keys, gradient handling, and one field per section.

Unlike DeepSpeed, which ignores unknown top-level keys, Slipstream rejects them (or warns with
`strict: false`).
Defaults are DeepSpeed 0.19's (`runtime/config.py`); `gradient_clipping` defaults to 1.0 as in 0.19.3+.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator

from slipstream.config.schema.base import DSBool, DSFloat, DSInt, DSModel, aliased
from slipstream.config.schema.compression import CompressionTrainingConfig
from slipstream.config.schema.data import CurriculumLearningConfig, DataEfficiencyConfig, ProgressiveLayerDropConfig
from slipstream.config.schema.eigenvalue import EigenvalueConfig
from slipstream.config.schema.inference import HybridEngineConfig
from slipstream.config.schema.misc import (
    ActivationCheckpointingConfig,
    AioConfig,
    AutotuningConfig,
    CheckpointConfig,
    CompileConfig,
    ElasticityConfig,
    EnabledSection,
    PipelineConfig,
    TensorParallelConfig,
)
from slipstream.config.schema.monitors import (
    CometConfig,
    CommsLoggerConfig,
    CSVConfig,
    FlopsProfilerConfig,
    TensorBoardConfig,
    TimersConfig,
    WandbConfig,
)
from slipstream.config.schema.optim import OptimizerConfig, SchedulerConfig
from slipstream.config.schema.precision import (
    AmpConfig,
    BF16Config,
    DataTypesConfig,
    Fp8Config,
    FP16Config,
    TorchAutocastConfig,
    canonical_dtype,
)
from slipstream.config.schema.zero import ZeroConfig

__all__ = ["DeepSpeedConfig"]

FreeForm = dict[str, Any] | None


def _infinity_is_never(value: object) -> Any:
    """`steps_per_print: float("inf")` (Accelerate writes it) means never: stored as None."""
    return None if isinstance(value, float) and math.isinf(value) and value > 0 else value


class DeepSpeedConfig(DSModel):
    """A whole DeepSpeed JSON config."""

    IMPLEMENTED = {
        "train_batch_size": "batch.train_batch_size",
        "train_micro_batch_size_per_gpu": "batch.micro_batch_size",
        "gradient_accumulation_steps": "batch.gradient_accumulation_steps",
        "steps_per_print": "logging.steps_per_print",
        "collective_timeout": "collective_timeout",
        "max_consecutive_skipped_steps": "precision.max_consecutive_skips",
        "wall_clock_breakdown": "logging.wall_clock_breakdown",
        "gradient_clipping": "gradient_clipping",
        "zero_allow_untested_optimizer": "zero.allow_untested_optimizer",
        "zero_force_ds_cpu_optimizer": "zero.force_host_optimizer",
        "dataloader_drop_last": "dataloader_drop_last",
        "strict": "",
        "sequence_parallel_size": "parallel.sp_size",
        "communication_data_type": "zero.reduce_dtype",
        "prescale_gradients": "precision.grad_predivide",
        "gradient_predivide_factor": "precision.grad_predivide",
        "sparse_gradients": "zero.sparse_gradients",
        "sparse_attention": "sparse_attention",
    }
    train_batch_size: DSInt | None = Field(None, gt=0)
    """Global batch: micro batch * gradient accumulation steps * data-parallel world size."""
    train_micro_batch_size_per_gpu: DSInt | None = Field(None, gt=0)
    """Samples per rank per forward/backward."""
    gradient_accumulation_steps: DSInt | None = Field(None, gt=0)
    """Micro batches accumulated before each optimizer step."""
    managed_gradient_accumulation: DSBool = True
    """The engine scales the loss by 1/gradient_accumulation_steps and skips steps between boundaries."""
    steps_per_print: Annotated[DSInt | None, BeforeValidator(_infinity_is_never)] = Field(None, gt=0)
    """Log progress every N optimizer steps; None (or infinity, which Accelerate writes) disables."""
    collective_timeout: float | None = Field(None, gt=0)
    """Slipstream only: seconds a collective may wait for every rank before CollectiveTimeout names the ranks
    that did not arrive; None uses SLIPSTREAM_TIMEOUT / DEEPSPEED_TIMEOUT / 5 minutes."""
    max_consecutive_skipped_steps: DSInt = Field(100, ge=0)
    """Slipstream only: with fp16 or bf16 overflow checks, raise (naming the first parameter with non-finite
    gradients) after this many consecutive optimizer steps were skipped for non-finite gradients, instead of
    training on without learning; 0 never raises."""
    wall_clock_breakdown: DSBool = False
    """Time forward, backward and step."""
    memory_breakdown: DSBool = False
    """Log memory use."""
    dump_state: DSBool = False
    """Print the engine state after initialisation."""
    gradient_clipping: DSFloat = Field(1.0, ge=0.0)
    """Clip the global gradient norm to this value; 0 disables."""
    prescale_gradients: DSBool = False
    """Divide gradients by the world size before the all-reduce (or reduce-scatter) instead of after."""
    gradient_predivide_factor: DSFloat = Field(1.0, gt=0.0)
    """Divide gradients by this before the all-reduce and by world_size / factor after."""
    gradient_allreduce_op: Literal["mean", "sum"] = "mean"
    """How gradients are combined across ranks."""
    communication_data_type: str | None = None
    """Dtype gradients are reduced in across data-parallel ranks ("fp32", "fp16", "bf16"), summed back into the
    gradient accumulation dtype; None: that accumulation dtype (data_types.grad_accum_dtype, fp32 unless set)."""
    seq_parallel_communication_data_type: str = "fp32"
    """Dtype of sequence-parallel communication."""
    sparse_gradients: DSBool = False
    """ZeRO stage 0: all-reduce nn.Embedding / nn.EmbeddingBag gradients as the rows they touch (indices and
    rows) when that is smaller than the table."""
    disable_allgather: DSBool = False
    """Disable all-gather of parameters after the step (legacy)."""
    zero_allow_untested_optimizer: DSBool = False
    """Allow ZeRO with an optimizer not on the tested list."""
    zero_force_ds_cpu_optimizer: DSBool = True
    """With CPU offload, require DeepSpeed's CPU optimizer for a client optimizer."""
    dataloader_drop_last: DSBool = False
    """Drop the last incomplete batch of the training data loader."""
    log_level: str | None = None
    """Log level of the engine's logger."""
    vocabulary_size: DSInt | None = None
    """Vocabulary size (a warning when not a multiple of 8)."""
    use_data_before_expert_parallelism: DSBool = False
    """Use the data before expert parallelism splits it."""
    graph_harvesting: DSBool = False
    """Capture CUDA graphs (accelerators that support it)."""
    sequence_parallel_size: DSInt | None = Field(None, gt=0)
    """Sequence-parallel degree of the device mesh."""
    data_parallel_size: DSInt | None = Field(None, gt=0)
    """Data-parallel degree of the device mesh."""
    strict: DSBool = True
    """Slipstream only: false turns unknown keys into one warning each instead of an error."""
    optimizer: OptimizerConfig | None = None
    """Optimizer built by the engine when the caller passes none."""
    scheduler: SchedulerConfig | None = None
    """LR scheduler built by the engine when the caller passes none."""
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    """ZeRO settings; `true` is stage 1."""
    fp16: FP16Config = Field(default_factory=FP16Config)
    """fp16 mixed precision."""
    bf16: BF16Config = aliased(BF16Config(), "bf16", "bfloat16")
    """bf16 mixed precision (also spelled `bfloat16`)."""
    amp: AmpConfig | None = None
    """Apex AMP."""
    torch_autocast: TorchAutocastConfig = Field(default_factory=TorchAutocastConfig)
    """torch.autocast in forward."""
    fp8: Fp8Config = Field(default_factory=Fp8Config)
    """FP8 training of linear layers (Slipstream's own section)."""
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig)
    """Gradient-accumulation and other dtypes."""
    activation_checkpointing: ActivationCheckpointingConfig = Field(default_factory=ActivationCheckpointingConfig)
    """Activation checkpointing."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Checkpoint I/O."""
    aio: AioConfig = Field(default_factory=AioConfig)
    """Asynchronous NVMe I/O."""
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig)
    """FLOPs profiler."""
    autotuning: AutotuningConfig = Field(default_factory=AutotuningConfig)
    """Autotuner."""
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    """TensorBoard monitor."""
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """Weights & Biases monitor."""
    csv_monitor: CSVConfig = Field(default_factory=CSVConfig)
    """CSV monitor."""
    comet: CometConfig = Field(default_factory=CometConfig)
    """Comet monitor."""
    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig)
    """Collective logging."""
    timers: TimersConfig = Field(default_factory=TimersConfig)
    """Timers."""
    elasticity: ElasticityConfig = Field(default_factory=ElasticityConfig)
    """Elastic training."""
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    """Pipeline parallelism."""
    sparse_attention: FreeForm = None
    """Sparse attention (keys as DeepSpeed documents them)."""
    progressive_layer_drop: ProgressiveLayerDropConfig = Field(default_factory=ProgressiveLayerDropConfig)
    """Progressive layer drop."""
    eigenvalue: EigenvalueConfig = Field(default_factory=EigenvalueConfig)
    """Block-Hessian eigenvalues written to the monitors."""
    quantize_training: EnabledSection = Field(default_factory=EnabledSection)
    """Quantization-aware training (MoQ)."""
    compression_training: CompressionTrainingConfig | None = None
    """Compression library settings (init_compression, the engine's compression scheduler)."""
    curriculum_learning: CurriculumLearningConfig = Field(default_factory=CurriculumLearningConfig)
    """Legacy curriculum learning."""
    data_efficiency: DataEfficiencyConfig = Field(default_factory=DataEfficiencyConfig)
    """Data efficiency library (sampling, routing)."""
    hybrid_engine: HybridEngineConfig = Field(default_factory=HybridEngineConfig)
    """Hybrid training/inference engine (RLHF)."""
    nebula: EnabledSection = Field(default_factory=EnabledSection)
    """Nebula checkpoint service."""
    datastates_ckpt: FreeForm = None
    """DataStates asynchronous checkpointing."""
    weight_quantization: FreeForm = None
    """Post-training weight quantization."""
    compile: CompileConfig = Field(default_factory=CompileConfig)
    """torch.compile / DeepCompile."""
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    """Tensor parallelism for training."""
    expert_parallel: FreeForm = None
    """Expert parallelism."""

    @field_validator("communication_data_type")
    @classmethod
    def _known_dtype(cls, value: str | None) -> str | None:
        return canonical_dtype(value)

    @field_validator("gradient_allreduce_op", mode="before")
    @classmethod
    def _allreduce_op(cls, value: object) -> Any:
        """Case-insensitive, as in DeepSpeed ("SUM" is "sum"); DeepSpeed's wording for anything else."""
        if isinstance(value, str) and value.lower() in ("mean", "sum"):
            return value.lower()
        raise ValueError(f"Invalid gradient_allreduce_op {value!r}: use 'mean' (the default) or 'sum'")

    @model_validator(mode="after")
    def _sum_allreduce_supported(self) -> DeepSpeedConfig:
        """DeepSpeed rejects summed gradients where its reduction path cannot sum; so does Slipstream."""
        if self.gradient_allreduce_op == "sum":
            for unsupported, where in (
                (self.zero_optimization.stage == 3, "ZeRO stage 3"),
                (self.zero_optimization.zenflow is not None, "ZenFlow (zero_optimization.zenflow)"),
                (self.compile.deepcompile, "DeepCompile (compile.deepcompile)"),
            ):
                if unsupported:
                    raise ValueError(
                        f"gradient_allreduce_op 'sum' is not supported with {where}; use 'mean' (the default)"
                    )
        return self

"""Sections Slipstream accepts but does not implement yet: activation checkpointing, checkpoint I/O, aio,
pipeline, elasticity, autotuning, compile, tensor parallel, and feature sections whose keys DeepSpeed does not
validate itself (these are `OpenSection`s: listed keys are type-checked, others are kept as given).

Setting any of them (enabled, or a non-default value) puts its dotted name in EnginePlan.unimplemented.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from slipstream.config.schema.base import DSBool, DSFloat, DSInt, DSModel, OpenSection, plan_fields

__all__ = [
    "ActivationCheckpointingConfig",
    "AioConfig",
    "AutotuningConfig",
    "CheckpointConfig",
    "CompileConfig",
    "ElasticityConfig",
    "EnabledSection",
    "PipelineConfig",
    "TensorParallelConfig",
]


class ActivationCheckpointingConfig(DSModel):
    """`activation_checkpointing` (`deepspeed.checkpointing.configure`)."""

    IMPLEMENTED = plan_fields(
        "activation_checkpointing",
        "partition_activations",
        "profile",
        "cpu_checkpointing",
        "contiguous_memory_optimization",
        "number_checkpoints",
        synchronize_checkpoint_boundary="activation_checkpointing.synchronize",
    )

    partition_activations: DSBool = False
    """Partition checkpointed activations across model-parallel ranks."""
    number_checkpoints: DSInt | None = None
    """Number of checkpoints, for contiguous memory."""
    contiguous_memory_optimization: DSBool = False
    """Copy checkpoints into one buffer."""
    synchronize_checkpoint_boundary: DSBool = False
    """Synchronise the device at checkpoint boundaries."""
    profile: DSBool = False
    """Time the checkpointed forward and recompute."""
    cpu_checkpointing: DSBool = False
    """Offload checkpoints to host memory."""


class CheckpointWriterConfig(DSModel):
    """`checkpoint.writer`."""

    type: str = "FAST"
    """MOCK, PYTHON or FAST."""
    io_buffer_size: DSInt = Field(64 * 1024 * 1024, gt=0)
    """Bytes of the I/O buffer."""
    io_buffer_double: DSBool = True
    """Double-buffer writes."""
    io_multiplier: DSInt = Field(1, ge=1)
    """I/O size multiplier."""
    show_statistics: DSBool = False
    """Print writer statistics."""
    data_parallel: str = "REPLICA"
    """REPLICA, SOCKET or MACHINE."""
    decoupled: DSBool = False
    """Write in a separate process."""


class ParallelWriteConfig(DSModel):
    """`checkpoint.parallel_write`."""

    pipeline_stage: DSBool = False
    """Each pipeline stage writes its own part."""


class CheckpointConfig(DSModel):
    """`checkpoint`: checkpoint I/O options."""

    IMPLEMENTED = {
        "tag_validation": "checkpoint.tag_validation",
        "load_universal": "checkpoint.load_universal",
    }

    tag_validation: Literal["WARN", "IGNORE", "FAIL"] = "WARN"
    """What to do when ranks disagree on the checkpoint tag."""
    load_universal: DSBool = False
    """`load_checkpoint(save_dir)` without a tag loads the universal checkpoint named by `latest_universal`
    (ds_to_universal's output) instead of the one `latest` names."""
    use_node_local_storage: DSBool = False
    """Save to node-local storage (every node writes)."""
    parallel_write: ParallelWriteConfig = Field(default_factory=ParallelWriteConfig)
    """Parallel write options."""
    checkpoint_serialization: DSBool = True
    """Use torch serialization for checkpoints."""
    writer: CheckpointWriterConfig | None = None
    """Fast checkpoint writer options."""

    @field_validator("tag_validation", mode="before")
    @classmethod
    def _upper(cls, value: object) -> Any:
        return value.upper() if isinstance(value, str) else value


class AioConfig(DSModel):
    """`aio`: asynchronous NVMe I/O."""

    IMPLEMENTED = {
        "block_size": "zero.offload_optimizer.aio.block_size",
        "queue_depth": "zero.offload_optimizer.aio.queue_depth",
        "intra_op_parallelism": "zero.offload_optimizer.aio.intra_op_parallelism",
        "single_submit": "zero.offload_optimizer.aio.single_submit",
        "overlap_events": "zero.offload_optimizer.aio.overlap_events",
    }

    block_size: DSInt = Field(1_048_576, gt=0)
    """Bytes per I/O request."""
    queue_depth: DSInt = Field(8, gt=0)
    """Requests in flight."""
    intra_op_parallelism: DSInt = Field(1, gt=0)
    """Threads per I/O operation."""
    single_submit: DSBool = False
    """Submit requests one at a time."""
    overlap_events: DSBool = True
    """Overlap submission and completion."""
    use_gds: DSBool = False
    """Use GPUDirect Storage."""


class PipelineConfig(OpenSection):
    """`pipeline`: pipeline parallelism."""

    IMPLEMENTED = {"activation_checkpoint_interval": "pipeline.activation_checkpoint_interval"}

    LITERAL_AUTO = frozenset({"stages"})
    stages: Literal["auto"] | DSInt = "auto"
    """Number of pipeline stages, or "auto"."""
    partition: str = "best"
    """Layer partitioning method."""
    seed_layers: DSBool = False
    """Seed each layer differently."""
    activation_checkpoint_interval: DSInt = 0
    """Layers between activation checkpoints."""
    pipe_partitioned: DSBool = True
    """Partition activations between stages."""
    grad_partitioned: DSBool = True
    """Partition gradients between stages."""


class ElasticityConfig(DSModel):
    """`elasticity`: elastic training batch sizes (config/elasticity.py; applied to the batch by resolve)."""

    IMPLEMENTED = {
        **dict.fromkeys(
            (
                "enabled",
                "max_train_batch_size",
                "min_gpus",
                "max_gpus",
                "num_gpus_per_node",
                "model_parallel_size",
                "prefer_larger_batch",
                "ignore_non_elastic_batch_info",
                "version",
            ),
            "batch.train_batch_size",
        ),
        "micro_batch_sizes": "batch.micro_batch_size",
    }

    enabled: DSBool = False
    """Compute the batch size from the elastic settings."""
    max_train_batch_size: DSInt = Field(2000, ge=1)
    """Largest acceptable global batch."""
    micro_batch_sizes: list[DSInt] = Field(default_factory=lambda: [2, 4, 6])
    """Acceptable micro batch sizes."""
    min_gpus: DSInt = Field(1, ge=1)
    """Fewest GPUs."""
    max_gpus: DSInt = Field(10000, ge=1)
    """Most GPUs."""
    num_gpus_per_node: DSInt = Field(1, ge=1)
    """GPUs per node."""
    model_parallel_size: DSInt = Field(1, ge=1)
    """Model-parallel size."""
    min_time: DSInt = 0
    """Minimum running time before scaling."""
    prefer_larger_batch: DSBool = True
    """Prefer the larger of equally good batch sizes."""
    ignore_non_elastic_batch_info: DSBool = False
    """Ignore the batch keys outside this section."""
    version: DSFloat = 0.2
    """Elasticity algorithm version."""


class AutotuningConfig(OpenSection):
    """`autotuning`: DeepSpeed's autotuner, behind `slipstream run --autotuning tune|run` (slipstream/autotuning/;
    further keys are kept as given)."""

    IMPLEMENTED = {
        "enabled": "autotuning.enabled",
        "results_dir": "autotuning.results_dir",
        "exps_dir": "autotuning.exps_dir",
        "overwrite": "autotuning.overwrite",
        "metric": "autotuning.metric",
        "metric_path": "autotuning.metric_path",
        "start_profile_step": "autotuning.start_profile_step",
        "end_profile_step": "autotuning.end_profile_step",
        "fast": "autotuning.fast",
        "max_train_batch_size": "autotuning.max_train_batch_size",
        "min_train_micro_batch_size_per_gpu": "autotuning.min_micro_batch_size",
        "max_train_micro_batch_size_per_gpu": "autotuning.max_micro_batch_size",
        "num_tuning_micro_batch_sizes": "autotuning.num_tuning_micro_batch_sizes",
        "tuner_early_stopping": "autotuning.tuner_early_stopping",
        "tuner_num_trials": "autotuning.tuner_num_trials",
        "tuner_type": "autotuning.tuner_type",
        "arg_mappings": "autotuning.arg_mappings",
        "min_train_batch_size": "autotuning.min_train_batch_size",
        "mp_size": "autotuning.mp_size",
    }

    enabled: DSBool = False
    """Profile this run: write the step metrics to `metric_path` after `end_profile_step`, then exit (the tuner
    sets it in each trial's config)."""
    fast: DSBool = True
    """Tune only the micro batch size, ZeRO stage and optimizer offload (false: the reduce bucket size too)."""
    results_dir: str = "autotuning_results"
    """Where results are written."""
    exps_dir: str = "autotuning_exps"
    """Where experiments are written."""
    overwrite: DSBool = True
    """Overwrite earlier results."""
    metric: Literal["throughput", "latency", "flops"] = "throughput"
    """What the best trial maximises (throughput, flops) or minimises (latency)."""
    metric_path: str | None = None
    """Metrics file of a profiled run (default ./autotuning_metric.json)."""
    start_profile_step: DSInt = Field(3, ge=0)
    """First profiled step."""
    end_profile_step: DSInt = Field(5, ge=1)
    """Last profiled step."""
    tuner_type: Literal["gridsearch", "random", "model_based"] = "gridsearch"
    """The order of the trials: the ranking's, a seeded random one, or one a model refitted after each trial picks."""
    tuner_early_stopping: DSInt = Field(5, ge=1)
    """Stop after this many experiments without improvement."""
    tuner_num_trials: DSInt = Field(50, ge=1)
    """Most experiments."""
    max_train_batch_size: DSInt | None = None
    """Largest global batch a trial may use."""
    min_train_batch_size: DSInt = Field(1, ge=1)
    """Smallest global batch a trial may use."""
    min_train_micro_batch_size_per_gpu: DSInt = Field(1, ge=1)
    """Smallest micro batch tried."""
    max_train_micro_batch_size_per_gpu: DSInt = Field(1024, ge=1)
    """Largest micro batch tried."""
    num_tuning_micro_batch_sizes: DSInt = Field(3, ge=1)
    """Micro batch sizes tried per ZeRO configuration."""
    mp_size: DSInt = Field(1, ge=1)
    """Model-parallel degree (the data-parallel ranks are the world over it)."""
    arg_mappings: dict[str, str] | None = None
    """Config key -> the training script's argument that carries its value (`{"train_micro_batch_size_per_gpu":
    "--per_device_train_batch_size"}`)."""


class CompileConfig(OpenSection):
    """`compile`: DeepCompile's options (further keys are kept as given). `engine.compile()` itself needs none of
    them (slipstream/compile/); DeepCompile is not built, so each key stays reported, and `deepcompile: true`
    makes engine.compile() refuse."""

    deepcompile: DSBool = False
    """Use DeepCompile (its graph passes are not built: engine.compile() refuses)."""
    autoep_non_moe: DSBool = False
    """Compile the callable parents of AutoEP layers, keeping AutoEP eager (AutoEP is not built)."""
    passes: list[Literal["z1", "z3", "autosp", "autotp"]] | None = None
    """DeepCompile's graph passes to compose."""
    free_activation: DSBool = False
    """Free activations early (DeepCompile)."""
    free_activation_threshold: DSInt = 10 * 1024 * 1024
    """Bytes from which activations are freed early (DeepCompile)."""
    offload_activation: DSBool = False
    """Offload activations saved for backward to host memory (DeepCompile)."""
    offload_activation_pin_memory: DSBool = True
    """Pin the host buffers of activation offload (DeepCompile)."""
    offload_opt_states: DSBool = False
    """Offload optimizer states during forward and backward (DeepCompile)."""
    offload_parameters: DSBool = False
    """Offload parameters (DeepCompile)."""
    double_buffer: DSBool = True
    """Double buffering of gathered parameters (DeepCompile)."""
    symmetric_memory: DSBool = False
    """Symmetric memory for collectives (DeepCompile)."""
    debug_log: DSBool = False
    """Dump DeepCompile's graphs."""
    sync_before_reduce: DSBool = False
    """Synchronise before each gradient reduction (DeepCompile)."""
    sync_after_reduce: DSBool = False
    """Synchronise after each gradient reduction (DeepCompile)."""
    sync_before_allgather: DSBool = False
    """Synchronise before each parameter all-gather (DeepCompile)."""
    sync_after_allgather: DSBool = False
    """Synchronise after each parameter all-gather (DeepCompile)."""
    keep_int_input_tensors: DSBool = True
    """Keep the values of integer input tensors when profiling (DeepCompile)."""
    keep_all_input_tensors: DSBool = False
    """Keep the values of all input tensors when profiling (DeepCompile)."""


class TensorParallelConfig(OpenSection):
    """`tensor_parallel`: automatic tensor parallelism for training (further keys are kept as given)."""

    IMPLEMENTED = {
        "autotp_size": "parallel.tp_size",
        "partition_config": "parallel.tp_rules",
    }

    autotp_size: DSInt = Field(0, ge=0)
    """Tensor-parallel degree; 0 disables AutoTP."""
    tp_overlap_comm: DSBool = False
    """Overlap tensor-parallel communication."""
    tp: dict[str, Any] | None = None
    """{"tp_size": 1, ...}."""
    partition_config: dict[str, Any] | None = None
    """Custom partition rules."""


class EnabledSection(OpenSection):
    """A feature section with an `enabled` switch whose other keys are kept as given (hybrid_engine,
    progressive_layer_drop, eigenvalue, nebula, sparse_attention, curriculum_learning, ...)."""

    enabled: DSBool = False
    """Turn the feature on."""

"""The DeepSpeed module paths client code imports, declared in one place (compat/aliases.py makes them import).

- `ALIASES`: a DeepSpeed path (spelled under `slipstream.`) whose module is one of ours, loaded as that module.
- `COMPOSITES`: a DeepSpeed module whose names live in several of ours, `{name: "module:attribute"}`; a value
  without ":" is a whole module, and the key "*" lists modules whose public names all belong.

A name DeepSpeed has whose feature Slipstream lacks points into compat/unbuilt.py: it imports, and using it
raises NotBuiltError naming the feature. tests/compat/client_paths.py lists the paths and names that
Transformers, Accelerate, Lightning, PEFT, TRL and Megatron-DeepSpeed import, and checks each.
"""

from __future__ import annotations

from slipstream.utils.expert_group_names import EXPERT_GROUP_FUNCTIONS

ALIASES: dict[str, str] = {
    "slipstream.utils.zero_to_fp32": "slipstream.compat.zero_to_fp32",
    "slipstream.checkpoint.ds_to_universal": "slipstream.compat.ds_to_universal",
    # DeepSpeed-format checkpoint tooling (docs/checkpoints.md): key names, restore into DeepSpeed's fragments
    "slipstream.checkpoint.constants": "slipstream.checkpoint.deepspeed.constants",
    "slipstream.checkpoint.universal_checkpoint": "slipstream.compat.universal_checkpoint",
    "slipstream.module_inject.tp_shard": "slipstream.compat.tp_shard",
    "slipstream.checkpointing": "slipstream.activation.recompute",
    "slipstream.comm.comm": "slipstream.comm.dist_api",
    "slipstream.runtime.activation_checkpointing.checkpointing": "slipstream.activation.recompute",
    "slipstream.runtime.zero": "slipstream.zero",
    "slipstream.runtime.zero.partition_parameters": "slipstream.zero.init",
    "slipstream.runtime.fp16.loss_scaler": "slipstream.zero.loss_scaler",
    "slipstream.runtime.config": "slipstream.compat.ds_config",
    "slipstream.runtime.pipe": "slipstream.pipe",
    "slipstream.moe.sharded_moe": "slipstream.moe.layer",  # TopKGate, MOELayer
    # launcher area (DeepSpeed's launcher unit tests): backend command builders, core-list/numactl helpers
    "slipstream.launcher.multinode_runner": "slipstream.compat.multinode_runner",
    "slipstream.utils.numa": "slipstream.compat.numa",
    # ALST for Hugging Face models (slipstream/sequence/hf.py, data.py, tiled.py) and the mpu it returns
    "slipstream.runtime.sequence_parallel.ulysses_sp": "slipstream.compat.ulysses_sp",
    "slipstream.runtime.sequence_parallel.parallel_state_sp": "slipstream.compat.parallel_state_sp",
    "slipstream.sequence.fpdt_layer": "slipstream.sequence.fpdt",  # FPDT / Ulysses-Offload
    # names Megatron-DeepSpeed, Lightning and TRL import (compat/*.py beside each)
    "slipstream.runtime.constants": "slipstream.compat.runtime_constants",
    "slipstream.runtime.zero.linear": "slipstream.compat.zero_linear",
    "slipstream.moe.mappings": "slipstream.compat.moe_mappings",
    "slipstream.monitor.monitor": "slipstream.compat.monitor_master",
    "slipstream.launcher.constants": "slipstream.compat.launcher_constants",
    "slipstream.env_report": "slipstream.report",
    "slipstream.compression.scheduler": "slipstream.compression.compress",  # compression_scheduler
    "slipstream.inference.config": "slipstream.config.schema.inference",  # DeepSpeedInferenceConfig
}
"""DeepSpeed-style path -> the module whose source it runs."""

_CFG = "slipstream.config.schema"
_RT = "slipstream.compat.runtime_utils"
_PA = "slipstream.compat.param_access"
_BUILDERS = "slipstream.ops.op_builder.deepspeed_names"
_NB = "slipstream.compat.unbuilt"
_SAFE_ACCESSORS = (
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_set_full_grad",
    "safe_get_local_grad",
    "safe_set_local_grad",
    "safe_get_full_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_optimizer_state",
    "safe_update_full_grad_vectorized",
)
"""compat/param_access.py's accessors (deepspeed.utils and deepspeed.utils.tensor_fragment)."""
_LEAF_FUNCTIONS = (
    "set_z3_leaf_modules",
    "unset_z3_leaf_modules",
    "get_z3_leaf_modules",
    "z3_leaf_module",
    "z3_leaf_parameter",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
)
"""ZeRO-3's leaf-module functions (zero/stage3/leaves.py): deepspeed.utils and deepspeed.utils.z3_leaf_module."""

COMPOSITES: dict[str, dict[str, str]] = {
    "slipstream.runtime": {
        "DeepSpeedOptimizer": "slipstream.zero.optimizer:ZeroOptimizer",
    },
    "slipstream.runtime.lr_schedules": {
        "*": "slipstream.engine.lr_schedules slipstream.compat.lr_names",
    },
    "slipstream.constants": {
        "TORCH_DISTRIBUTED_DEFAULT_PORT": "slipstream.comm.init:TORCH_DISTRIBUTED_DEFAULT_PORT",
    },
    "slipstream.runtime.engine": {
        "DeepSpeedEngine": "slipstream.engine.engine:SlipstreamEngine",
        "ADAM_OPTIMIZER": "slipstream.compat.ds_config:ADAM_OPTIMIZER",
        "ADAMW_OPTIMIZER": "slipstream.compat.ds_config:ADAMW_OPTIMIZER",
        "LAMB_OPTIMIZER": "slipstream.compat.ds_config:LAMB_OPTIMIZER",
        "MUON_OPTIMIZER": "slipstream.compat.ds_config:MUON_OPTIMIZER",
        "DeepSpeedOptimizerCallable": "slipstream.compat.runtime_utils:DeepSpeedOptimizerCallable",
        "DeepSpeedSchedulerCallable": "slipstream.compat.runtime_utils:DeepSpeedSchedulerCallable",
        "_checkpoint_parallel_metadata": "slipstream.checkpoint.deepspeed.layout:parallel_dimensions_record",
    },
    "slipstream.checkpoint": {  # a package of ours: answered by its __getattr__
        "*": "slipstream.checkpoint.deepspeed.constants",
        "DeepSpeedCheckpoint": "slipstream.checkpoint.deepspeed.folder:DeepSpeedCheckpointFolder",
        "ZeROCheckpoint": "slipstream.checkpoint.deepspeed.folder:ZeroFiles",
        "model_3d_desc": "slipstream.checkpoint.deepspeed.layout:ParallelDegrees",
        "get_model_3d_descriptor": "slipstream.checkpoint.deepspeed.layout:get_model_3d_descriptor",
        "meg_2d_parallel_map": "slipstream.checkpoint.deepspeed.layout:RankMap2D",
        "reshape_meg_2d_parallel": "slipstream.checkpoint.deepspeed.layout:reshape_2d",
        "SubparamShape": "slipstream.checkpoint.deepspeed.subparam:SubparamShape",
        "enable_universal_checkpoint": "slipstream.compat.universal_checkpoint:enable_universal_checkpoint",
        "get_model_ckpt_name_for_rank": "slipstream.compat.checkpoint_names:get_model_ckpt_name_for_rank",
        "get_zero_ckpt_name_for_rank": "slipstream.compat.checkpoint_names:get_zero_ckpt_name_for_rank",
        "get_layer_ckpt_name_for_rank": "slipstream.compat.checkpoint_names:get_layer_ckpt_name_for_rank",
    },
    "slipstream.module_inject": {},  # the package of the tp_shard alias
    "slipstream.runtime.utils": {
        "see_memory_usage": f"{_RT}:see_memory_usage",
        "set_random_seed": f"{_RT}:set_random_seed",
        "RepeatingLoader": "slipstream.engine.dataloader:RepeatingLoader",
        "clip_grad_norm_": f"{_RT}:clip_grad_norm_",
        "get_global_norm": f"{_RT}:get_global_norm",
        "move_to_device": f"{_RT}:move_to_device",
        "partition_uniform": "slipstream.pipe.partition:partition_uniform",
        "partition_balanced": "slipstream.pipe.partition:partition_balanced",
        "prefix_sum_inc": f"{_RT}:prefix_sum_inc",
        "PartitionedTensor": f"{_RT}:PartitionedTensor",
    },
    "slipstream.runtime.sequence_parallel": {},  # the package of the two aliases above
    "slipstream.runtime.dataloader": {
        "RepeatingLoader": "slipstream.engine.dataloader:RepeatingLoader",
    },
    "slipstream.runtime.config_utils": {
        "DeepSpeedConfigModel": f"{_CFG}.base:DSModel",
        "DeepSpeedConfigError": "slipstream.config.errors:ConfigError",
    },
    "slipstream.runtime.zero.config": {
        "DeepSpeedZeroConfig": f"{_CFG}.zero:ZeroConfig",
        "DeepSpeedZeroOffloadParamConfig": f"{_CFG}.zero:OffloadParamConfig",
        "DeepSpeedZeroOffloadOptimizerConfig": f"{_CFG}.zero:OffloadOptimizerConfig",
        "ZeroStageEnum": "slipstream.compat.ds_config:ZeroStageEnum",
    },
    "slipstream.runtime.zenflow": {},
    "slipstream.runtime.zenflow.zenflow_config": {"ZenFlowConfig": f"{_CFG}.zero:ZenFlowConfig"},
    "slipstream.runtime.zenflow.zenflow_stage_1_and_2": {  # isinstance(engine.optimizer, ZenFlowZeroOptimizer)
        "ZenFlowZeroOptimizer": "slipstream.zero.zenflow:ZenFlowMixin",
    },
    "slipstream.runtime.zero.leaf_module_config": {  # zero_optimization.leaf_module
        "DeepSpeedZeroLeafModuleConfig": f"{_CFG}.zero:LeafModuleConfig",
        "DEFAULT_LEAF_MODULE_CLASSES": f"{_CFG}.zero:DEFAULT_LEAF_MODULE_CLASSES",
        "DEFAULT_LEAF_MODULE_NAMES": f"{_CFG}.zero:DEFAULT_LEAF_MODULE_NAMES",
        "DEFAULT_LEAF_MODULE_NAME_SUFFIXES": f"{_CFG}.zero:DEFAULT_LEAF_MODULE_NAME_SUFFIXES",
    },
    "slipstream.runtime.zero.stage3": {
        "DeepSpeedZeroOptimizer_Stage3": "slipstream.zero.stage3.optimizer:Stage3Optimizer",
        "estimate_zero3_model_states_mem_needs_all_live": "slipstream.planner:estimate_zero3_model_states_mem_needs_all_live",
        "estimate_zero3_model_states_mem_needs_all_cold": "slipstream.planner:estimate_zero3_model_states_mem_needs_all_cold",
    },
    "slipstream.runtime.zero.mics": {"MiCS_Init": "slipstream.zero.mics:MicsInit"},  # zero.Init for MiCS
    "slipstream.runtime.zero.stage_1_and_2": {
        "DeepSpeedZeroOptimizer": "slipstream.zero.optimizer:ZeroOptimizer",
        "estimate_zero2_model_states_mem_needs_all_live": "slipstream.planner:estimate_zero2_model_states_mem_needs_all_live",
        "estimate_zero2_model_states_mem_needs_all_cold": "slipstream.planner:estimate_zero2_model_states_mem_needs_all_cold",
    },
    "slipstream.runtime.activation_checkpointing": {
        "checkpointing": "slipstream.activation.recompute",
    },
    "slipstream.runtime.swap_tensor": {"MIN_SWAPPABLE_BYTES": f"{_RT}:MIN_SWAPPABLE_BYTES"},
    "slipstream.utils.timer": {
        "ThroughputTimer": "slipstream.utils.throughput:ThroughputTimer",
        "SynchronizedWallClockTimer": "slipstream.compat.timers:SynchronizedWallClockTimer",
        "NoopTimer": "slipstream.compat.timers:NoopTimer",
    },
    "slipstream.utils.logging": {"logger": f"{_RT}:logger", "log_dist": f"{_RT}:log_dist"},  # a module of ours
    "slipstream.utils.init_on_device": {"OnDevice": f"{_RT}:OnDevice"},
    "slipstream.utils.z3_leaf_module": {  # also callable: the import sets this module on deepspeed.utils, where
        # DeepSpeed has the function of the same name
        **{name: f"slipstream.zero.stage3.leaves:{name}" for name in _LEAF_FUNCTIONS},
        "__call__": "slipstream.zero.stage3.leaves:z3_leaf_module",
    },
    "slipstream.utils.tensor_fragment": {name: f"{_PA}:{name}" for name in _SAFE_ACCESSORS},
    "slipstream.runtime.base_optimizer": {
        "DeepSpeedOptimizer": "slipstream.zero.optimizer:ZeroOptimizer",
        "ZeROOptimizer": "slipstream.zero.optimizer:ZeroOptimizer",
    },
    "slipstream.ops.lamb": {"FusedLamb": "slipstream.optim.lamb:FusedLamb"},
    "slipstream.ops.sparse_attention.sparse_self_attention": {
        "SparseSelfAttention": "slipstream.ops.sparse_attention.attention:SparseSelfAttention"
    },
    "slipstream.ops.sparse_attention.sparsity_config": {
        "*": "slipstream.ops.sparse_attention.layouts slipstream.ops.sparse_attention.sparsity_window"
    },
    "slipstream.monitor": {},  # the package of the monitor alias
    # the 1-bit optimizers (slipstream/optim/onebit/)
    "slipstream.runtime.fp16.onebit": {
        "OnebitAdam": "slipstream.optim.onebit.adam:OneBitAdam",
        "ZeroOneAdam": "slipstream.optim.onebit.zoadam:ZeroOneAdam",
        "OnebitLamb": "slipstream.optim.onebit.lamb:OneBitLamb",
    },
    "slipstream.runtime.fp16.onebit.adam": {"OnebitAdam": "slipstream.optim.onebit.adam:OneBitAdam"},
    "slipstream.runtime.fp16.onebit.zoadam": {"ZeroOneAdam": "slipstream.optim.onebit.zoadam:ZeroOneAdam"},
    "slipstream.runtime.fp16.onebit.lamb": {"OnebitLamb": "slipstream.optim.onebit.lamb:OneBitLamb"},
    # Muon: DeepSpeed's package is empty, the class is in muon_optimizer
    "slipstream.runtime.zero.muon": {},
    "slipstream.runtime.zero.muon.muon_optimizer": {"MuonWithAuxAdam": "slipstream.optim.muon:MuonWithAuxAdam"},
    "slipstream.runtime.zero.muon.original_muon": {
        "muon_update": "slipstream.optim.muon:muon_update",
        "MuonWithAuxAdam": "slipstream.optim.muon:MuonWithAuxAdam",
    },
    # DeepSpeed features Slipstream does not have: importable, NotBuiltError when used (compat/unbuilt.py)
    "slipstream.autotuning": {"Autotuner": f"{_NB}:Autotuner"},
    "slipstream.launcher.launch": {"main": f"{_NB}:launch_main"},
    "slipstream.runtime.pipe.p2p": {name: f"{_NB}:{name}" for name in ("send", "recv", "wait", "send_obj", "recv_obj")},
    "slipstream.runtime.zero.parameter_offload": {"DeepSpeedZeRoOffload": f"{_NB}:DeepSpeedZeRoOffload"},
    "slipstream.runtime.zero.offload_states": {
        name: f"{_NB}:{name}"
        for name in (
            "offload_optimizer_states",
            "reload_optimizer_states",
            "offload_adam_states",
            "reload_adam_states",
            "get_state_devices",
        )
    },
    "slipstream.runtime.progressive_layer_drop": {
        "ProgressiveLayerDrop": "slipstream.compat.layer_drop:ProgressiveLayerDrop"
    },
    "slipstream.runtime.data_pipeline": {},
    "slipstream.runtime.data_pipeline.curriculum_scheduler": {
        "CurriculumScheduler": "slipstream.compat.curriculum_scheduler:CurriculumScheduler"
    },
    "slipstream.runtime.data_pipeline.data_sampling": {},
    "slipstream.runtime.data_pipeline.data_sampling.data_sampler": {
        "DeepSpeedDataSampler": "slipstream.compat.data_sampler:DeepSpeedDataSampler"
    },
    "slipstream.runtime.data_pipeline.data_sampling.data_analyzer": {
        "DataAnalyzer": "slipstream.data.analyzer:MetricAnalyzer"
    },
    "slipstream.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr": {
        name: f"slipstream.compat.variable_batch_size_and_lr:{name}"
        for name in (
            "batch_by_seqlens",
            "scale_lr",
            "VariableBatchSizeLR",
            "get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed",
        )
    },
    "slipstream.runtime.data_pipeline.data_routing": {},
    "slipstream.runtime.data_pipeline.data_routing.basic_layer": {
        "RandomLayerTokenDrop": "slipstream.data.random_ltd_layer:RandomLayerTokenDrop"
    },
    "slipstream.runtime.data_pipeline.data_routing.helper": {
        name: f"slipstream.data.random_ltd_layer:{name}"
        for name in ("convert_to_random_ltd", "save_without_random_ltd", "remove_random_ltd_state_dict")
    },
    "slipstream.runtime.data_pipeline.data_routing.scheduler": {
        "RandomLTDScheduler": "slipstream.data.random_ltd:RandomLTDScheduler"
    },
    "slipstream.runtime.zero.offload_config": {
        "DeepSpeedZeroOffloadParamConfig": f"{_CFG}.zero:OffloadParamConfig",
        "DeepSpeedZeroOffloadOptimizerConfig": f"{_CFG}.zero:OffloadOptimizerConfig",
        "OffloadDeviceEnum": "slipstream.compat.ds_config:OffloadDeviceEnum",
        "OffloadStateTypeEnum": "slipstream.zero.state_buffers:OffloadStateTypeEnum",
    },
    "slipstream.runtime.zero.utils": {
        "ZeRORuntimeException": f"{_RT}:ZeRORuntimeException",
        "is_zero_supported_optimizer": f"{_RT}:is_zero_supported_optimizer",
        "apply_to_tensors_only": f"{_RT}:apply_to_tensors_only",
    },
    "slipstream.runtime.precision_config": {
        "DeepSpeedFP16Config": f"{_CFG}.precision:FP16Config",
        "DeepSpeedBF16Config": f"{_CFG}.precision:BF16Config",
        "get_float16_config": "slipstream.compat.ds_config:get_float16_config",
        "get_bfloat16_config": "slipstream.compat.ds_config:get_bfloat16_config",
    },
    "slipstream.runtime.fp16": {
        "DynamicLossScaler": "slipstream.zero.loss_scaler:DynamicLossScaler",
        "LossScaler": "slipstream.zero.loss_scaler:StaticLossScaler",
    },
    "slipstream.runtime.fp16.fused_optimizer": {
        "FP16_Optimizer": "slipstream.zero.optimizer:ZeroOptimizer",
    },
    "slipstream.runtime.fp16.unfused_optimizer": {
        "FP16_UnfusedOptimizer": "slipstream.zero.optimizer:ZeroOptimizer",
    },
    "slipstream.runtime.bf16_optimizer": {
        "BF16_Optimizer": "slipstream.zero.optimizer:ZeroOptimizer",
    },
    "slipstream.runtime.checkpoint_engine": {
        "CheckpointEngine": "slipstream.compat.checkpoint_engine:CheckpointEngine",
        "TorchCheckpointEngine": "slipstream.compat.checkpoint_engine:TorchCheckpointEngine",
    },
    "slipstream.runtime.checkpoint_engine.checkpoint_engine": {
        "CheckpointEngine": "slipstream.compat.checkpoint_engine:CheckpointEngine",
    },
    "slipstream.runtime.checkpoint_engine.torch_checkpoint_engine": {
        "TorchCheckpointEngine": "slipstream.compat.checkpoint_engine:TorchCheckpointEngine",
    },
    "slipstream.ops.adagrad": {
        "DeepSpeedCPUAdagrad": "torch.optim:Adagrad",
    },
    "slipstream.ops.lion": {
        "DeepSpeedCPULion": "slipstream.engine.optimizers:Lion",
        "FusedLion": "slipstream.engine.optimizers:Lion",
    },
    "slipstream.checkpoint.utils": {
        "clone_tensors_for_torch_save": f"{_RT}:clone_tensors_for_torch_save",
        # DeepSpeed's checkpoint file names (compat/checkpoint_names.py)
        "get_model_ckpt_name_for_rank": "slipstream.compat.checkpoint_names:get_model_ckpt_name_for_rank",
        "get_zero_ckpt_name_for_rank": "slipstream.compat.checkpoint_names:get_zero_ckpt_name_for_rank",
        "get_layer_ckpt_name_for_rank": "slipstream.compat.checkpoint_names:get_layer_ckpt_name_for_rank",
    },
    "slipstream.utils": {
        "logger": f"{_RT}:logger",
        "log_dist": f"{_RT}:log_dist",
        "RepeatingLoader": "slipstream.engine.dataloader:RepeatingLoader",
        # ZeRO-3 leaf modules (zero/stage3/leaves.py)
        **{name: f"slipstream.zero.stage3.leaves:{name}" for name in _LEAF_FUNCTIONS},
        "OnDevice": f"{_RT}:OnDevice",
        **{name: f"{_PA}:{name}" for name in _SAFE_ACCESSORS},
        "groups": "slipstream.compat.groups",
        "is_initialized": "slipstream.comm.init:is_initialized",
    },
    "slipstream.utils.groups": {
        name: f"slipstream.compat.groups:{name}"
        for name in (
            "get_data_parallel_group",
            "get_data_parallel_world_size",
            "get_data_parallel_rank",
            "get_model_parallel_world_size",
            "get_model_parallel_rank",
            "get_tensor_model_parallel_world_size",
            "get_tensor_model_parallel_rank",
            "get_sequence_parallel_world_size",
            "get_sequence_parallel_rank",
            "get_sequence_parallel_group",
            "_get_sequence_parallel_group",
            "_get_sequence_parallel_world_size",
            "_get_sequence_parallel_rank",
            "_get_data_parallel_group",
            "_get_data_parallel_world_size",
            "_get_data_parallel_rank",
        )
    }
    | {  # the expert groups of MoE (slipstream/moe/groups.py, DeepSpeed's names)
        name: f"slipstream.moe.groups:{name}" for name in EXPERT_GROUP_FUNCTIONS
    },
    "slipstream.utils.torch": {
        "required_torch_version": f"{_RT}:required_torch_version",
    },
    "slipstream.ops": {
        "__compatible_ops__": f"{_BUILDERS}:compatible_ops",
        "adam": "slipstream.ops.adam",
        "op_builder": "slipstream.ops.op_builder",
    },
}
"""DeepSpeed path -> {name: "module:attribute"} for modules whose names live in several of ours. A value
without ":" is a whole module; the key "*" lists modules (space-separated) whose public names all belong."""

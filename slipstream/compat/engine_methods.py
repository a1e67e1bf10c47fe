"""The rest of DeepSpeed 0.19's public `DeepSpeedEngine` methods (reference: deepspeed/runtime/engine.py).

The engine's own files define what it does (forward, backward, step, save, load: engine/; the common getters:
engine_getters.py). This mixin, last before `nn.Module` in the engine's bases, gives every other public method
of DeepSpeed's engine one of three answers:

- a config getter (`CONFIG_GETTERS`): the value of the resolved config (`engine.config`, DeepSpeed's keys with
  defaults), or DeepSpeed's default when the key is absent;
- a method that works (`zero_cpu_offload`, `empty_partition_cache`, `module_state_dict`, `deepspeed_io`, ...);
- `NotImplementedError` naming the method and why (`NOT_IMPLEMENTED`): features Slipstream does not have
  (DeepCompile, curriculum learning, progressive layer drop, sparse gradients, ...) or DeepSpeed's internal
  gradient-reduction helpers, which have no counterpart in Slipstream's reduction (docs/design.md D7).

It also registers each engine (weakly) for the `safe_get_*` helpers (compat/param_access.py), and passes an
attribute the engine does not have through to the wrapped model, as DeepSpeed's engine does
(`engine.config_class`, a custom method of the model; `engine.generate` is the engine's own, in
engine/weight_handoff.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from slipstream.compat.engine_attributes import EngineAttributes
from slipstream.compat.param_access import register_engine
from slipstream.compile.engine_compile import CompiledEngine
from slipstream.config.precision_plans import DEFAULT_SAFE_MODULES
from slipstream.config.schema.zero import ZeroConfig

_Z = "zero_optimization"
_ZERO_DEFAULTS = ZeroConfig()  # the schema's defaults of a config without zero_optimization
CONFIG_GETTERS: dict[str, tuple[str, Any]] = {
    "aio_config": ("aio", {}),
    "amp_enabled": ("amp.enabled", False),
    "amp_params": ("amp", {}),
    "autotp_size": ("tensor_parallel.autotp_size", 0),
    "autotuning_enabled": ("autotuning.enabled", False),
    "autotuning_start_profile_step": ("autotuning.start_profile_step", 3),
    "autotuning_end_profile_step": ("autotuning.end_profile_step", 5),
    "autotuning_metric": ("autotuning.metric", "throughput"),
    "autotuning_metric_path": ("autotuning.metric_path", None),
    "autotuning_model_info_path": ("autotuning.model_info_path", None),
    "autotuning_profile_model_info": ("autotuning.model_info.profile", False),
    "bf16_master_weights_and_gradients": ("bf16.bf16_master_weights_and_grads", False),
    "bf16_optimizer_states": ("bf16.bf16_optimizer_states", False),
    "checkpoint_serialization_enabled": ("checkpoint.use_node_local_storage", False),
    "checkpoint_writer_enabled": ("checkpoint.writer", None),
    "communication_data_type": ("communication_data_type", None),
    "curriculum_enabled_legacy": ("curriculum_learning.enabled", False),
    "curriculum_params_legacy": ("curriculum_learning", {}),
    "curriculum_learning_enabled": ("data_efficiency.data_sampling.curriculum_learning.enabled", False),
    "curriculum_learning_config": ("data_efficiency.data_sampling.curriculum_learning", {}),
    "data_efficiency_config": ("data_efficiency", {}),
    "data_efficiency_enabled": ("data_efficiency.enabled", False),
    "data_sampling_config": ("data_efficiency.data_sampling", {}),
    "data_sampling_enabled": ("data_efficiency.data_sampling.enabled", False),
    "dataloader_drop_last": ("dataloader_drop_last", False),
    "dump_state": ("dump_state", False),
    "eigenvalue_enabled": ("eigenvalue.enabled", False),
    "eigenvalue_verbose": ("eigenvalue.verbose", False),
    "eigenvalue_max_iter": ("eigenvalue.max_iter", 100),
    "eigenvalue_tol": ("eigenvalue.tol", 1e-2),
    "eigenvalue_stability": ("eigenvalue.stability", 1e-6),
    "eigenvalue_gas_boundary_resolution": ("eigenvalue.gas_boundary_resolution", 1),
    "eigenvalue_layer_name": ("eigenvalue.layer_name", "bert.encoder.layer"),
    "eigenvalue_layer_num": ("eigenvalue.layer_num", 0),
    "elasticity_enabled": ("elasticity.enabled", False),
    "flops_profiler_enabled": ("flops_profiler.enabled", False),
    "flops_profiler_recompute_fwd_factor": ("flops_profiler.recompute_fwd_factor", 0.0),
    "flops_profiler_profile_step": ("flops_profiler.profile_step", 1),
    "flops_profiler_module_depth": ("flops_profiler.module_depth", -1),
    "flops_profiler_top_modules": ("flops_profiler.top_modules", 1),
    "flops_profiler_detailed": ("flops_profiler.detailed", True),
    "flops_profiler_output_file": ("flops_profiler.output_file", None),
    "fp16_auto_cast": ("fp16.auto_cast", False),
    "fp16_master_weights_and_gradients": ("fp16.fp16_master_weights_and_grads", False),
    "gradient_predivide_factor": ("gradient_predivide_factor", 1.0),
    "graph_harvesting": ("graph_harvesting", False),
    "load_universal_checkpoint": ("checkpoint.load_universal", False),
    "memory_breakdown": ("memory_breakdown", False),
    "mics_shard_size": (f"{_Z}.mics_shard_size", -1),
    "optimizer_legacy_fusion": ("optimizer.legacy_fusion", False),
    "optimizer_params": ("optimizer.params", None),
    "pld_enabled": ("progressive_layer_drop.enabled", False),
    "pld_params": ("progressive_layer_drop", False),
    "pld_theta": ("progressive_layer_drop.theta", 1.0),
    "pld_gamma": ("progressive_layer_drop.gamma", 0.001),
    "random_ltd_enabled": ("data_efficiency.data_routing.random_ltd.enabled", False),
    "random_ltd_config": ("data_efficiency.data_routing.random_ltd", {}),
    "scheduler_params": ("scheduler.params", None),
    "sparse_gradients_enabled": ("sparse_gradients", False),
    "swap_tensor_config": (f"{_Z}.offload_optimizer", None),
    "tensor_parallel_config": ("tensor_parallel", {}),
    "torch_autocast_enabled": ("torch_autocast.enabled", False),
    "torch_autocast_dtype": ("torch_autocast.dtype", None),
    "torch_autocast_lower_precision_safe_modules": (
        "torch_autocast.lower_precision_safe_modules",
        list(DEFAULT_SAFE_MODULES),  # DeepSpeed's getter answers its default list when the key is unset
    ),
    "use_node_local_storage": ("checkpoint.use_node_local_storage", False),
    "zenflow_config": (f"{_Z}.zenflow", None),
    "zero_allgather_bucket_size": (f"{_Z}.allgather_bucket_size", 500_000_000),
    "zero_allgather_partitions": (f"{_Z}.allgather_partitions", True),
    "zero_allgather_sequential": (f"{_Z}.allgather_sequential", False),
    "zero_allow_untested_optimizer": ("zero_allow_untested_optimizer", False),
    "zero_contiguous_gradients": (f"{_Z}.contiguous_gradients", True),
    "zero_elastic_checkpoint": (f"{_Z}.elastic_checkpoint", False),
    "zero_force_ds_cpu_optimizer": ("zero_force_ds_cpu_optimizer", True),
    "zero_grad_hooks": (f"{_Z}.grad_hooks", True),
    "zero_hpz_partition_size": (f"{_Z}.zero_hpz_partition_size", 1),
    "zero_ignore_unused_parameters": (f"{_Z}.ignore_unused_parameters", True),
    "zero_legacy_stage1": (f"{_Z}.legacy_stage1", False),
    "zero_load_from_fp32_weights": (f"{_Z}.load_from_fp32_weights", True),
    "zero_log_trace_cache_warnings": (f"{_Z}.log_trace_cache_warnings", False),
    "zero_max_live_parameters": (f"{_Z}.stage3_max_live_parameters", 1_000_000_000),
    "zero_max_reuse_distance": (f"{_Z}.stage3_max_reuse_distance", 1_000_000_000),
    "zero_model_persistence_threshold": (f"{_Z}.stage3_model_persistence_threshold", 2**63 - 1),
    "zero_module_granularity_threshold": (f"{_Z}.stage3_module_granularity_threshold", 0),
    "zero_multi_rank_bucket_allreduce": (f"{_Z}.use_multi_rank_bucket_allreduce", True),
    "zero_offload_param": (f"{_Z}.offload_param", None),
    "zero_overlap_comm": (f"{_Z}.overlap_comm", _ZERO_DEFAULTS.overlap_comm),
    "zero_param_persistence_threshold": (f"{_Z}.stage3_param_persistence_threshold", 100_000),
    "zero_partial_offload": (f"{_Z}.offload_optimizer.ratio", 1.0),
    "zero_prefetch_bucket_size": (f"{_Z}.stage3_prefetch_bucket_size", 50_000_000),
    "zero_quantized_gradients": (f"{_Z}.zero_quantized_gradients", False),
    "zero_quantized_nontrainable_weights": (f"{_Z}.zero_quantized_nontrainable_weights", False),
    "zero_quantized_weights": (f"{_Z}.zero_quantized_weights", False),
    "zero_reduce_bucket_size": (f"{_Z}.reduce_bucket_size", _ZERO_DEFAULTS.reduce_bucket_size),
    "zero_reduce_scatter": (f"{_Z}.reduce_scatter", True),
    "zero_round_robin_gradients": (f"{_Z}.round_robin_gradients", False),
    "zero_save_muon_momentum_buffer_in_memory": (f"{_Z}.save_muon_momentum_buffer_in_memory", False),
    "zero_sub_group_size": (f"{_Z}.sub_group_size", _ZERO_DEFAULTS.sub_group_size),
    "zeropp_loco_param": (f"{_Z}.zeropp_loco_param", None),
}
"""DeepSpeed getter -> (dotted key of the resolved config, DeepSpeed's default)."""

_REDUCTION = "Slipstream reduces gradients inside the ZeRO optimizer, once per step (docs/design.md D7); call backward() and step()"
NOT_IMPLEMENTED: dict[str, str] = {
    "all_gather_scalar": _REDUCTION,
    "allreduce_and_copy": _REDUCTION,
    "allreduce_bucket": _REDUCTION,
    "allreduce_gradients": _REDUCTION,
    "allreduce_no_retain": _REDUCTION,
    "buffered_allreduce_fallback": _REDUCTION,
    "clip_fp32_gradients": "gradients are clipped inside step() by the config's gradient_clipping",
    "coalesce_grad_reduction": "accumulate with gradient_accumulation_steps, or set_gradient_accumulation_boundary()",
    "sparse_all_gather": "sparse gradients are not implemented",
    "sparse_allreduce": "sparse gradients are not implemented",
    "sparse_allreduce_bucket": "sparse gradients are not implemented",
    "sparse_allreduce_no_retain": "sparse gradients are not implemented",
    "compile_autosp": "DeepCompile is not implemented",
    "compile_autotp": "DeepCompile is not implemented",
    "compile_zero_optimization_stage": "DeepCompile is not implemented",
    "register_compile_pass": "DeepCompile is not implemented",
    "get_deepcompile_backend": "DeepCompile is not implemented",
    "get_deepspeed_compile_backend": "DeepCompile is not implemented",
    "get_autosp_backend": "DeepCompile is not implemented",
    "get_autotp_backend": "DeepCompile is not implemented",
    "get_compile_time": "DeepCompile is not implemented",
    "uses_parallelization_pass_only": "DeepCompile is not implemented",
    "super_offload": "SuperOffload is not implemented; use offload_optimizer",
    "load_moe_state_dict": "MoE checkpoints load through load_checkpoint",
    "quantize_training": "quantization-aware training is not implemented",
    "active_timers": "DeepSpeed's engine timers are not implemented; see wall_clock_breakdown",
    "print_forward_breakdown": "DeepSpeed's engine timers are not implemented; see wall_clock_breakdown",
    "get_wall_clock_timers": "DeepSpeed's engine timers are not implemented; see wall_clock_breakdown",
    "log_level": "set SLIPSTREAM_LOG=debug|info|warning instead",
}
"""DeepSpeed engine method -> why it is not offered here."""


def _config_getter(name: str, key: str, default: Any) -> Callable[[Any], Any]:
    def getter(self: Any) -> Any:
        value: Any = getattr(self, "config", None) or {}
        for part in key.split("."):
            if not isinstance(value, dict) or part not in value:
                return default
            value = value[part]
        return default if value is None and default is not None else value

    getter.__name__ = name
    getter.__doc__ = f"DeepSpeed's `{name}()`: config `{key}` (default {default!r})."
    return getter


def _refusal(name: str, why: str) -> Callable[..., Any]:
    def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"engine.{name}() is not implemented in Slipstream: {why}")

    refuse.__name__ = name
    return refuse


class DeepSpeedEngineMethods(CompiledEngine, EngineAttributes):
    """See the module doc. Attributes it reads are the engine's."""

    config: Any
    plan: Any
    module: Any
    zero_model: Any
    global_rank: int
    world_size: int
    parallel: Any
    global_steps: int
    _forward_schedules: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        register_engine(self)

    def __getattr__(self, name: str) -> Any:
        """nn.Module's lookup (parameters, buffers, submodules), then the wrapped model's attribute."""
        try:
            return super().__getattr__(name)  # type: ignore[misc]
        except AttributeError:
            pass
        module = self.__dict__.get("_modules", {}).get("module")
        if module is not None and not (name.startswith("__") and name.endswith("__")):
            try:
                return getattr(module, name)
            except AttributeError:
                pass
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}' (nor has its module)")

    def random_ltd_initialize(self) -> None:
        """Make the model's RandomLayerTokenDrop wrappers named by random_ltd_layer_id drop tokens (data/)."""
        from slipstream.data.random_ltd_layer import attach_random_ltd

        scheduler = self._forward_schedules.random_ltd
        if scheduler is None:
            raise RuntimeError(
                "engine.random_ltd_initialize(): random-LTD is off; enable it in the config "
                '("data_efficiency": {"data_routing": {"random_ltd": {"enabled": true, ...}}})'
            )
        attach_random_ltd(self.module, scheduler.plan, scheduler)

    @property
    def random_ltd_scheduler(self) -> Any:
        """DeepSpeed's attribute: the kept-token schedule (data/random_ltd.py), None when random-LTD is off."""
        return self._forward_schedules.random_ltd

    def get_pld_theta(self) -> float | None:
        """Progressive layer drop's keep probability for the next forward; None when it is off."""
        layer_drop = self._forward_schedules.layer_drop
        return None if layer_drop is None else layer_drop.theta_for_step(self.global_steps)

    # ---- checks on the config that DeepSpeed computes ----
    def zero_cpu_offload(self) -> bool:
        """True when the optimizer state is offloaded to the CPU (Accelerate and Transformers ask)."""
        return _device(self.plan.zero.offload_optimizer) == "cpu"

    def zero_use_cpu_optimizer(self) -> bool:
        return _device(self.plan.zero.offload_optimizer) in ("cpu", "nvme")

    def zero_nvme_offload_optimizer(self) -> bool:
        return _device(self.plan.zero.offload_optimizer) == "nvme"

    def checkpoint_tag_validation_enabled(self) -> bool:
        return str(_dotted(self.config, "checkpoint.tag_validation", "Warn")).upper() != "IGNORE"

    def checkpoint_tag_validation_fail(self) -> bool:
        return str(_dotted(self.config, "checkpoint.tag_validation", "Warn")).upper() == "FAIL"

    def dynamic_loss_scale(self) -> bool:
        return self.plan.precision.param_dtype == "fp16" and float(_dotted(self.config, "fp16.loss_scale", 0)) == 0

    def initial_dynamic_scale(self) -> float:
        return float(2 ** int(_dotted(self.config, "fp16.initial_scale_power", 16)))

    def dynamic_loss_scale_args(self) -> dict[str, Any] | None:
        if not self.dynamic_loss_scale():
            return None
        fp16 = _dotted(self.config, "fp16", {}) or {}
        return {
            "init_scale": self.initial_dynamic_scale(),
            "scale_window": fp16.get("loss_scale_window", 1000),
            "delayed_shift": fp16.get("hysteresis", 2),
            "consecutive_hysteresis": fp16.get("consecutive_hysteresis", False),
            "min_scale": fp16.get("min_loss_scale", 1),
        }

    def postscale_gradients(self) -> bool:
        return not bool(_dotted(self.config, "prescale_gradients", False))

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """(model parameter dtype, gradient accumulation dtype)."""
        names = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
        precision = self.plan.precision
        return names[precision.param_dtype], names.get(precision.grad_accum_dtype, torch.float32)

    def get_model_parallel_rank(self) -> int:
        """This rank's index in its tensor-parallel group (DeepSpeed's model parallel is its tensor parallel)."""
        return self.parallel.tp_rank

    def get_tensor_parallel_rank(self) -> int:
        return self.parallel.tp_rank

    def is_first_weights_partition_group(self) -> bool:
        """DeepSpeed 0.19's definition: whether the weights are partitioned (ZeRO-3), whatever the rank."""
        return self.plan.zero.stage >= 3

    def _never(self) -> bool:
        """DeepSpeed's questions about what Slipstream's engine does not do (DeepCompile, elastic
        model parallelism, sanity checks, accumulation managed by a compiler): always False."""
        return False

    is_deepcompile_enabled = is_deepcompile_active = _never
    is_elastic_model_parallel_supported = is_sanity_checks_enabled = managed_gradient_accumulation = _never

    def cpuadam_cores_perc(self) -> float:
        return float(_dotted(self.config, f"{_Z}.offload_optimizer.cpuadam_cores_perc", 0.8))

    # ---- data ----
    @staticmethod
    def is_map_style_dataset(obj: Any) -> bool:
        return hasattr(obj, "__getitem__") and hasattr(obj, "__len__")

    @staticmethod
    def is_iterable_style_dataset(obj: Any) -> bool:
        return isinstance(obj, torch.utils.data.IterableDataset)

    def deepspeed_io(
        self,
        dataset: Any,
        batch_size: int | None = None,
        route: Any = None,
        pin_memory: bool = True,
        data_sampler: Any = None,
        collate_fn: Any = None,
        num_local_io_workers: int | None = None,
    ) -> torch.utils.data.DataLoader:
        """A DataLoader over this data-parallel rank's share of `dataset` (a DistributedSampler over the
        data-parallel replicas: a pipeline's stage or a TP group reads one share), micro-batch sized."""
        from torch.utils.data import DataLoader, DistributedSampler

        if self.plan.schedules.sampling is not None and route in (None, "train"):  # the curriculum sampler
            return self._curriculum_loader(dataset, batch_size, collate_fn)
        if data_sampler is None and not self.is_iterable_style_dataset(dataset):
            getters: Any = self  # the engine's data-parallel getters (engine_getters.py, pipe/engine.py)
            data_sampler = DistributedSampler(
                dataset,
                num_replicas=getters.get_data_parallel_world_size(),
                rank=getters.get_data_parallel_rank(),
                shuffle=False,
                drop_last=bool(_dotted(self.config, "dataloader_drop_last", False)),
            )
        return DataLoader(
            dataset,
            batch_size=batch_size or self.plan.batch.micro_batch_size,
            sampler=data_sampler,
            collate_fn=collate_fn,
            num_workers=num_local_io_workers or 0,
            pin_memory=pin_memory and torch.cuda.is_available(),
            drop_last=bool(_dotted(self.config, "dataloader_drop_last", False)),
        )

    def _curriculum_loader(self, dataset: Any, batch_size: int | None, collate_fn: Any) -> Any:
        from slipstream.data.sampled_loader import CurriculumDataLoader

        getters: Any = self
        return CurriculumDataLoader(
            dataset,
            self.plan.schedules.sampling,
            micro_batch_size=batch_size or self.plan.batch.micro_batch_size,
            rank_and_size=(getters.get_data_parallel_rank(), getters.get_data_parallel_world_size()),
            gradient_accumulation_steps=self.plan.batch.gradient_accumulation_steps,
            drop_last=self.plan.dataloader_drop_last,
            collate_fn=collate_fn,
        )

    def set_custom_curriculum_learning_schedule(self, schedule_func_dict: dict[str, Any]) -> None:
        """Give the curriculum sampler's custom-schedule metrics their functions (step -> difficulty); nothing
        without the curriculum sampler, as in DeepSpeed."""
        sampler = getattr(getattr(self, "training_dataloader", None), "data_sampler", None)
        if sampler is not None and hasattr(sampler, "set_custom_curriculum_learning_schedule"):
            sampler.set_custom_curriculum_learning_schedule(schedule_func_dict)

    def set_data_post_process_func(self, post_process_func: Any) -> None:
        """Hand each batch of the curriculum loader, with the sampler's state, to `post_process_func` (DeepSpeed's
        hook; it changes nothing without the curriculum sampler, as in DeepSpeed)."""
        loader = getattr(self, "training_dataloader", None)
        if loader is not None and hasattr(loader, "post_process_func"):
            loader.post_process_func = post_process_func

    # ---- module state and caches ----
    def module_state_dict(
        self,
        destination: Any = None,
        prefix: str = "",
        keep_vars: bool = False,
        exclude_frozen_parameters: bool = False,
    ) -> dict[str, Any]:
        """The model's state dict (at ZeRO-3 each rank's parameters are its shards: use save_16bit_model or
        `_zero3_consolidated_16bit_state_dict` for full tensors)."""
        state = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            frozen = {prefix + n for n, p in self.module.named_parameters() if not p.requires_grad}
            state = type(state)((k, v) for k, v in state.items() if k not in frozen)
        return state

    def load_module_state_dict(
        self, checkpoint: dict[str, Any], strict: bool = True, custom_load_fn: Any = None, fetch_z3_params: bool = False
    ) -> None:
        """Load `checkpoint["module"]` into the model (DeepSpeed's signature)."""
        state = checkpoint["module"] if "module" in checkpoint else checkpoint
        if custom_load_fn is not None:
            custom_load_fn(src=state, dst=self.module)
        else:
            self.module.load_state_dict(state, strict=strict)

    def save_fp16_model(self, save_dir: str, save_filename: str = "pytorch_model.bin", **kwargs: Any) -> Any:
        """DeepSpeed's older name of save_16bit_model."""
        save: Any = getattr(self, "save_16bit_model")  # noqa: B009 (defined by the engine's model_saving mixin)
        return save(save_dir, save_filename, **kwargs)

    def empty_partition_cache(self) -> None:
        """Free every gathered ZeRO-3 unit nobody holds (after evaluation or generation), and the accelerator's
        cache. Units gathered for a running forward/backward or a GatheredParameters block stay."""
        zero_model: Any = getattr(self, "zero_model", None)
        for unit in getattr(zero_model, "units", []):
            if zero_model._hold(unit, 0) == 0:
                unit.release()
        if zero_model is not None:
            zero_model.pool.drop_idle()  # the pool's gathered memory no unit holds now
        from slipstream.accelerator import get_accelerator

        get_accelerator().empty_cache()


def _device(target: Any) -> str:
    return str(getattr(target, "kind", "none"))


def _dotted(config: Any, key: str, default: Any) -> Any:
    value = config or {}
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return default
        value = value[part]
    return value


for _name, (_key, _default) in CONFIG_GETTERS.items():
    setattr(DeepSpeedEngineMethods, _name, _config_getter(_name, _key, _default))
for _name, _why in NOT_IMPLEMENTED.items():
    setattr(DeepSpeedEngineMethods, _name, _refusal(_name, _why))

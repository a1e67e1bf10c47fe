"""DeepSpeed's module paths that client code imports, mapped to where the code lives here.

Two tables, the one place such paths are declared, so the package's own layers keep their layout (a compat
tool never has to live in utils/ for its DeepSpeed path):

- `ALIASES`: a path with no file of its own whose module is one of ours. Importing it gives the target
  module itself (one object: its classes and state are shared, and a library that swaps one of its
  attributes swaps it for our code too), and `python -m <alias>` runs the target's code. Names below an
  alias resolve below its target (`slipstream.runtime.zero.stage3` is `slipstream.zero.stage3`).
- `COMPOSITES`: a DeepSpeed module whose names live in several of ours (`deepspeed.runtime.utils` has a data
  loader, a seeding helper and a memory report). Each name is `"module:attribute"`, loaded on first access.
  A path that is not a module of ours becomes a small module object holding just those names; a package
  of ours that is also a DeepSpeed path (`slipstream.utils`, `slipstream.ops`) answers them from its
  `__getattr__` through `composite_attribute`.

`add_prefix` maps a whole import name onto ours: the opt-in `deepspeed` distribution (compat/deepspeed_dist.py)
registers `deepspeed` -> `slipstream`, so `import deepspeed.runtime.zero.partition_parameters` works.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["ALIASES", "COMPOSITES", "add_prefix", "composite_attribute", "composite_names", "install"]

ALIASES: dict[str, str] = {
    "slipstream.utils.zero_to_fp32": "slipstream.compat.zero_to_fp32",
    "slipstream.checkpoint.ds_to_universal": "slipstream.compat.ds_to_universal",
    # DeepSpeed-format checkpoint tooling (docs/checkpoints.md): key names, restore into DeepSpeed's fragments
    "slipstream.checkpoint.constants": "slipstream.checkpoint.ds_constants",
    "slipstream.checkpoint.universal_checkpoint": "slipstream.compat.universal_checkpoint",
    "slipstream.module_inject.tp_shard": "slipstream.compat.tp_shard",
    "slipstream.checkpointing": "slipstream.activation.checkpointing",
    "slipstream.comm.comm": "slipstream.comm.dist_api",
    "slipstream.runtime.activation_checkpointing.checkpointing": "slipstream.activation.checkpointing",
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
}
"""DeepSpeed-style path -> the module whose source it runs."""

_CFG = "slipstream.config.schema"
_RT = "slipstream.compat.runtime_utils"
_PA = "slipstream.compat.param_access"
_BUILDERS = "slipstream.ops.op_builder.deepspeed_names"

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
        "_checkpoint_parallel_metadata": "slipstream.checkpoint.ds_layout:parallel_dimensions_record",
    },
    "slipstream.checkpoint": {  # a package of ours: answered by its __getattr__
        "*": "slipstream.checkpoint.ds_constants",
        "DeepSpeedCheckpoint": "slipstream.checkpoint.ds_folder:DeepSpeedCheckpointFolder",
        "ZeROCheckpoint": "slipstream.checkpoint.ds_folder:ZeroFiles",
        "model_3d_desc": "slipstream.checkpoint.ds_layout:ParallelDegrees",
        "get_model_3d_descriptor": "slipstream.checkpoint.ds_layout:get_model_3d_descriptor",
        "meg_2d_parallel_map": "slipstream.checkpoint.ds_layout:RankMap2D",
        "reshape_meg_2d_parallel": "slipstream.checkpoint.ds_layout:reshape_2d",
        "SubparamShape": "slipstream.checkpoint.subparam:SubparamShape",
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
    "slipstream.runtime.zero.stage_1_and_2": {
        "DeepSpeedZeroOptimizer": "slipstream.zero.optimizer:ZeroOptimizer",
        "estimate_zero2_model_states_mem_needs_all_live": "slipstream.planner:estimate_zero2_model_states_mem_needs_all_live",
        "estimate_zero2_model_states_mem_needs_all_cold": "slipstream.planner:estimate_zero2_model_states_mem_needs_all_cold",
    },
    "slipstream.runtime.activation_checkpointing": {
        "checkpointing": "slipstream.activation.checkpointing",
    },
    "slipstream.runtime.swap_tensor": {"MIN_SWAPPABLE_BYTES": f"{_RT}:MIN_SWAPPABLE_BYTES"},
    "slipstream.utils.timer": {"ThroughputTimer": "slipstream.utils.throughput:ThroughputTimer"},
    "slipstream.runtime.zero.offload_config": {
        "DeepSpeedZeroOffloadParamConfig": f"{_CFG}.zero:OffloadParamConfig",
        "DeepSpeedZeroOffloadOptimizerConfig": f"{_CFG}.zero:OffloadOptimizerConfig",
        "OffloadDeviceEnum": "slipstream.compat.ds_config:OffloadDeviceEnum",
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
        **{
            name: f"slipstream.zero.stage3.leaves:{name}"
            for name in (
                "set_z3_leaf_modules",
                "unset_z3_leaf_modules",
                "get_z3_leaf_modules",
                "z3_leaf_module",
                "z3_leaf_parameter",
                "set_z3_leaf_modules_by_name",
                "set_z3_leaf_modules_by_suffix",
            )
        },
        "OnDevice": f"{_RT}:OnDevice",
        **{
            name: f"{_PA}:{name}"
            for name in (
                "safe_get_full_fp32_param",
                "safe_get_full_grad",
                "safe_set_full_grad",
                "safe_get_local_grad",
                "safe_set_local_grad",
                "safe_get_full_optimizer_state",
                "safe_set_full_fp32_param",
                "safe_set_full_optimizer_state",
                "safe_get_local_fp32_param",
                "safe_get_local_grad",
                "safe_get_local_optimizer_state",
                "safe_set_local_fp32_param",
                "safe_set_local_optimizer_state",
                "safe_update_full_grad_vectorized",
            )
        },
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
        name: f"slipstream.moe.groups:{name}"
        for name in (
            "_create_expert_and_data_parallel",
            "_get_expert_parallel_ranks",
            "_get_expert_parallel_group",
            "_get_expert_parallel_group_dict",
            "_get_expert_data_parallel_group",
            "_get_expert_data_parallel_group_dict",
            "_get_expert_parallel_world_size",
            "_get_expert_parallel_rank",
            "_get_expert_data_parallel_world_size",
            "_get_expert_data_parallel_rank",
            "_get_expert_broadcast_src_rank",
            "_get_max_expert_size",
            "_get_max_expert_size_name",
        )
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

_PREFIXES: dict[str, str] = {}
"""Import names mapped onto ours (`deepspeed` -> `slipstream`), registered by `add_prefix`."""


def _load(where: str) -> Any:
    import importlib

    module_name, _, attribute = where.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attribute) if attribute else module


def composite_attribute(module_name: str, name: str) -> Any:
    """The DeepSpeed name `name` of module `module_name` (COMPOSITES), or AttributeError."""
    names = COMPOSITES.get(module_name, {})
    if name in names and name != "*":
        return _load(names[name])
    for source in names.get("*", "").split():
        module = _load(source)
        if not name.startswith("_") and hasattr(module, name):
            return getattr(module, name)
    child = declared_child(module_name, name)
    if child is not None:  # DeepSpeed imports its subpackages eagerly: `deepspeed.runtime.lr_schedules` works
        return child
    raise AttributeError(f"module {module_name!r} has no attribute {name!r}")


def declared_child(module_name: str, name: str) -> Any:
    """The declared DeepSpeed path `module_name.name` (an alias or a composite) as a module, or None."""
    fullname = f"{module_name}.{name}"
    if fullname not in ALIASES and fullname not in COMPOSITES:
        return None
    import importlib

    return importlib.import_module(fullname)


def composite_names(module_name: str) -> list[str]:
    """Every DeepSpeed name of `module_name` (for `dir()` and `__all__`)."""
    names = COMPOSITES.get(module_name, {})
    found = {name for name in names if name != "*"}
    for source in names.get("*", "").split():
        module = _load(source)
        found |= set(getattr(module, "__all__", [n for n in vars(module) if not n.startswith("_")]))
    return sorted(found)


def _target(fullname: str) -> str | None:
    """Our module for `fullname` by the longest aliased (or prefixed) ancestor, or None."""
    if fullname in ALIASES:
        return ALIASES[fullname]
    parts = fullname.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        head, tail = ".".join(parts[:cut]), ".".join(parts[cut:])
        if head in ALIASES:
            return f"{ALIASES[head]}.{tail}"
        if head in _PREFIXES:
            return f"{_PREFIXES[head]}.{tail}"
    return None


class _AliasLoader:
    """Loads an alias as the target module itself (one module object, so classes and state are shared), and
    gives `python -m <alias>` the target's code to run as __main__."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: Any) -> Any:
        import importlib

        module = importlib.import_module(self.target)
        self._target_spec = module.__spec__
        return module

    def exec_module(self, module: Any) -> None:
        module.__spec__ = self._target_spec  # the import system stamped the alias spec on the shared module

    def get_code(self, fullname: str) -> Any:
        import importlib.util

        spec = importlib.util.find_spec(self.target)
        get_code = getattr(None if spec is None else spec.loader, "get_code", None)
        return None if get_code is None else get_code(self.target)


class _CompositeLoader:
    """Makes a small package holding one COMPOSITES entry's names, each loaded on first access."""

    def create_module(self, spec: Any) -> Any:
        name = spec.name
        module = types.ModuleType(name, f"DeepSpeed's `{name}` names (declared in slipstream/compat/aliases.py).")
        module.__path__ = []  # a package: DeepSpeed paths below it may be composites too
        module.__getattr__ = lambda attribute: composite_attribute(name, attribute)  # type: ignore[method-assign]
        module.__dir__ = lambda: composite_names(name)  # type: ignore[method-assign]
        return module

    def exec_module(self, module: Any) -> None:
        return None


def _declared_below_target(fullname: str) -> str | None:
    """The declared DeepSpeed path that `fullname` spells through an alias's target, or None.

    `from slipstream.runtime.zero import config` looks up `config` below the module's own name,
    `slipstream.zero`; that name stands for the declared `slipstream.runtime.zero.config`."""
    for alias, target in ALIASES.items():
        if fullname.startswith(target + "."):
            candidate = alias + fullname[len(target) :]
            if candidate in ALIASES or candidate in COMPOSITES:
                return candidate
    return None


def _is_ours(fullname: str) -> bool:
    """True when `fullname` is a file of the package under its own name (the regular finders load it)."""
    import importlib.machinery

    parent = sys.modules.get(fullname.rpartition(".")[0])
    if parent is None or parent.__name__ != fullname.rpartition(".")[0]:
        return False
    search = getattr(parent, "__path__", None)
    return bool(search) and importlib.machinery.PathFinder.find_spec(fullname, search) is not None


class _AliasFinder:
    """A meta path finder for the names of `ALIASES`, `COMPOSITES` and registered prefixes. It runs first, so a
    name below an alias never loads a second copy of one of our files; any other name costs a few dict
    lookups. importlib.util is imported on the first alias lookup (`import slipstream` stays cheap)."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: Any = None) -> Any:
        if not fullname.startswith(("slipstream.", *(prefix + "." for prefix in _PREFIXES))):
            return None
        import importlib.util

        if fullname in COMPOSITES:
            if _is_ours(fullname):
                return None  # a package of ours that also answers DeepSpeed names (its __getattr__)
            composite: Any = _CompositeLoader()
            return importlib.util.spec_from_loader(fullname, composite, is_package=True)
        target_name = _target(fullname)
        if target_name is None and not _is_ours(fullname):
            target_name = _declared_below_target(fullname)
        if target_name is None:
            return None
        if target_name not in COMPOSITES and importlib.util.find_spec(target_name) is None:
            return None
        loader: Any = _AliasLoader(target_name)
        return importlib.util.spec_from_loader(fullname, loader)


def add_prefix(prefix: str, target: str) -> None:
    """Map every module below `prefix` to the same path below `target` (`deepspeed.zero` -> `slipstream.zero`)."""
    _PREFIXES[prefix] = target


def install() -> None:
    """Register the alias finder once per interpreter, ahead of the regular finders (`import slipstream`)."""
    if not any(isinstance(finder, _AliasFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder())

"""`InferencePlan`: `init_inference`'s config (a dict, a JSON file, keyword arguments) resolved once; and the
training config's `hybrid_engine` section as the engine plan's `HybridPlan` (`hybrid_plan`).

DeepSpeed's rules kept here: keyword arguments override the config's keys; the deprecated `mp_size` stands for
`tensor_parallel.tp_size`; `tensor_parallel.enabled: false` means one rank. The keys Slipstream does not act on
are listed in `unimplemented` (reported once by name by the engine).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path

from pydantic import ValidationError

from slipstream.config.errors import ConfigError, pydantic_problems
from slipstream.config.keys import unimplemented_keys
from slipstream.config.plan import HybridPlan, ParallelPlan
from slipstream.config.schema.inference import DeepSpeedInferenceConfig, HybridEngineConfig

__all__ = ["InferencePlan", "hybrid_plan", "resolve_inference"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class InferencePlan:
    """What inference/engine.py builds (field docs: the schema's keys)."""

    dtype: str
    """"fp32" | "fp16" | "bf16" | "int8" (int8: linear weights quantized to int8, the rest in fp16)."""
    tp_size: int
    checkpoint: str | None
    """A folder: a Slipstream checkpoint (manifest.json, or save_dir with `latest`) or Hugging Face safetensors."""
    max_out_tokens: int
    cuda_graph: bool
    kernel_inject: bool
    unimplemented: tuple[str, ...]


def _as_dict(config: object) -> dict[str, object]:
    if config is None:
        return {}
    if isinstance(config, (str, Path)):
        with open(config, encoding="utf-8") as handle:
            loaded = json.load(handle)
        return dict(loaded)
    if isinstance(config, DeepSpeedInferenceConfig):
        return config.model_dump(exclude_unset=True, by_alias=False)
    if isinstance(config, Mapping):
        return dict(config)
    raise TypeError(
        f"init_inference(config=...): expected a dict, a path to a JSON file or a DeepSpeedInferenceConfig, got "
        f"{type(config).__name__}"
    )


def _checkpoint_path(value: str | Mapping[str, object] | None) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise ConfigError(
        [
            "checkpoint: DeepSpeed's checkpoint description dicts (Megatron / ds_model shard lists) are not "
            "supported; give the path of a Slipstream checkpoint or of a Hugging Face safetensors folder"
        ]
    )


def resolve_inference(config: object = None, **kwargs: object) -> InferencePlan:
    """The plan of `init_inference(model, config, **kwargs)` (kwargs win over the config's keys)."""
    merged = {**_as_dict(config), **kwargs}
    try:
        cfg = DeepSpeedInferenceConfig.model_validate(merged)
    except ValidationError as error:
        raise ConfigError(pydantic_problems(error)) from None
    tp = cfg.tensor_parallel
    tp_size = tp.tp_size if tp.enabled else 1
    if cfg.mp_size > 1 and tp_size == 1:
        tp_size = cfg.mp_size
    return InferencePlan(
        dtype=cfg.dtype,
        tp_size=tp_size,
        checkpoint=_checkpoint_path(cfg.checkpoint),
        max_out_tokens=cfg.max_out_tokens,
        cuda_graph=cfg.enable_cuda_graph,
        kernel_inject=cfg.replace_with_kernel_inject,
        unimplemented=tuple(unimplemented_keys(cfg)),
    )


def hybrid_plan(section: HybridEngineConfig, parallel: ParallelPlan, world_size: int) -> HybridPlan:
    """The `hybrid_engine` section as the engine's plan (engine/weight_handoff.py); `inference_tp_size` > 1 is
    checked against the layout (groups of consecutive data-parallel ranks; raises ConfigError naming what
    does not fit)."""
    tp = section.inference_tp_size
    if section.enabled and tp > 1:
        _check_generation_groups(section, parallel, world_size)
    return HybridPlan(
        generate=section.enabled,
        pin_parameters=section.pin_parameters,
        max_out_tokens=section.max_out_tokens,
        inference_tp_size=tp,
        tp_gather_partition_size=section.tp_gather_partition_size,
        release_inference_cache=section.release_inference_cache,
    )


def _check_generation_groups(section: HybridEngineConfig, parallel: ParallelPlan, world_size: int) -> None:
    key = f"hybrid_engine.inference_tp_size={section.inference_tp_size}"
    problems: list[str] = []
    if parallel.tp_size > 1 or parallel.sp_size > 1:
        problems.append(
            f"{key} with tensor_parallel.autotp_size={parallel.tp_size} and sequence_parallel_size="
            f"{parallel.sp_size}: generation groups over a model already split for training are not built; set "
            "inference_tp_size to 1 or train without tensor / sequence parallelism"
        )
    elif world_size % section.inference_tp_size:
        problems.append(
            f"{key} does not divide the data-parallel world size {world_size}: the ranks form generation groups "
            f"of {section.inference_tp_size} consecutive ranks; use a divisor of {world_size}"
        )
    if not section.pin_parameters:
        problems.append(
            f"{key} with hybrid_engine.pin_parameters=false: generating per layer from the module hooks with the "
            "layers split over ranks is not built; set pin_parameters to true (the inference copy is refilled "
            "tp_gather_partition_size layers at a time) or inference_tp_size to 1"
        )
    if problems:
        raise ConfigError(problems)

"""The entry points of DeepSpeed's API: `initialize`, `init_distributed`, `add_config_arguments`."""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch.distributed as dist
from torch import nn

from slipstream.comm.init import init_distributed
from slipstream.utils.errors import ArgumentError
from slipstream.utils.logging import log_rank0

__all__ = ["add_config_arguments", "initialize", "init_distributed"]


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's `--deepspeed` / `--deepspeed_config` arguments (and the deprecated deepscale ones)."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true", help="enable DeepSpeed (Slipstream)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


def _config_source(args: object, config: object, config_params: object) -> Any:
    """DeepSpeed's precedence: `config` (or legacy `config_params`), or `args.deepspeed_config`; not both."""
    given = config if config is not None else config_params
    from_args = None
    if args is not None:
        from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if given is not None and from_args is not None:
        raise ArgumentError(
            "the config was given twice: as initialize(config=...) and as args.deepspeed_config="
            f"{from_args!r}; pass only one"
        )
    if given is None and from_args is None:
        raise ArgumentError(
            "no config given: pass initialize(config=dict_or_path) or --deepspeed_config path.json "
            "(with add_config_arguments(parser))"
        )
    return given if given is not None else from_args


def _given_keys(resolved: object, given: object) -> Any:
    """The resolved values of the keys the user wrote (the full resolved config is logged at debug level)."""
    if not isinstance(given, dict) or not isinstance(resolved, dict):
        return resolved
    return {key: _given_keys(resolved.get(key, value), value) for key, value in given.items()}


def initialize(
    args: object = None,
    model: nn.Module | None = None,
    optimizer: object = None,
    model_parameters: object = None,
    training_data: object = None,
    lr_scheduler: object = None,
    distributed_port: int = 29500,
    mpu: object = None,
    dist_init_required: bool | None = None,
    collate_fn: object = None,
    config: object = None,
    mesh_param: object = None,
    config_params: object = None,
    *,
    strict: bool | None = None,
) -> tuple[Any, Any, Any, Any]:
    """Build the engine. Returns `(engine, optimizer, training_dataloader, lr_scheduler)` as DeepSpeed does.

    The optimizer returned is the one DeepSpeed returns: the basic optimizer itself (the client's object, what
    the client's callable built, or the config's) at ZeRO stage 0 in fp32, where DeepSpeed does not wrap it;
    otherwise the engine's ZeRO optimizer (`engine.optimizer`). Argument errors are `ArgumentError` /
    `ArgumentTypeError`: ValueError / TypeError that are also AssertionError, which DeepSpeed raises there.
    """
    if model is None:
        raise ArgumentError("initialize() needs model=<torch.nn.Module>")
    if mesh_param is not None:
        raise NotImplementedError("initialize(mesh_param=...) is not available yet in Slipstream")
    from slipstream.config import load_config

    raw = load_config(_config_source(args, config, config_params))
    if mpu is not None:
        raw = _with_sequence_mpu(raw, mpu)
    _join_process_group(raw, args, distributed_port=distributed_port, dist_init_required=dist_init_required)
    pipeline = _is_pipeline(model)
    plan = _resolve_plan(raw, model, pipeline=pipeline, strict=strict)
    from slipstream.engine.builders import ClientObjects

    client = ClientObjects(optimizer, model_parameters, lr_scheduler, training_data, collate_fn)
    engine = _engine_class(pipeline=pipeline)(model, plan, client)
    return engine, engine._optimizer_to_return(), engine.training_dataloader, engine.lr_scheduler


def _join_process_group(raw: Any, args: Any, *, distributed_port: int, dist_init_required: bool | None) -> None:
    """Create (or join) the process group with the config's collective timeout, and set `args.local_rank`."""
    from slipstream.comm import collectives
    from slipstream.config import collective_timeout_of

    timeout = collective_timeout_of(raw)
    if timeout is not None:  # before the group exists, so it is created with it (an existing one gets set_timeout)
        collectives.set_collective_timeout(timeout)
    init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required, verbose=False)
    collectives.apply_to_group()  # SLIPSTREAM_TIMEOUT / DEEPSPEED_TIMEOUT reach a group created elsewhere too
    if args is not None and hasattr(args, "local_rank"):
        import os

        args.local_rank = int(os.environ.get("LOCAL_RANK", "0"))


def _resolve_plan(raw: Any, model: nn.Module, *, pipeline: bool, strict: bool | None) -> Any:
    """The plan for `model` over the data-parallel world (a pipeline's stages divide it); the keys the user
    gave are logged with their resolved values."""
    from slipstream.config import resolve

    hidden_size = getattr(getattr(model, "config", None), "hidden_size", None)
    data_world = dist.get_world_size() // (int(getattr(model, "num_stages", 1)) if pipeline else 1)
    raw = _with_recorded_tp(raw, model)
    plan = resolve(raw, world_size=data_world, strict=strict, hidden_size=hidden_size)
    log_rank0(
        "config as given, resolved: " + json.dumps(_given_keys(plan.resolved, raw), default=str), rank=dist.get_rank()
    )
    return plan


def _with_sequence_mpu(raw: Any, mpu: Any) -> Any:
    """The config with the sequence-parallel size of `mpu`: the one `register_with_transformers` returns
    (DeepSpeed's `parallel_state_sp`) is the only mpu taken; its groups are the mesh the engine builds."""
    from slipstream.compat import parallel_state_sp

    if mpu is not parallel_state_sp:
        raise NotImplementedError(
            f"initialize(mpu={getattr(mpu, '__name__', type(mpu).__name__)}): a Megatron-style mpu is not supported; "
            "Slipstream takes the mpu of UlyssesSPAttentionHF.register_with_transformers, and builds tensor and "
            "sequence parallel groups itself from the config (tensor_parallel.autotp_size, sequence_parallel_size)"
        )
    size = mpu.get_sequence_parallel_world_size()
    given = raw.get("sequence_parallel_size") if isinstance(raw, dict) else None
    if given not in (None, size):
        raise ValueError(
            f"initialize: config sequence_parallel_size={given} but the mpu's sequence groups have {size} ranks "
            "(register_with_transformers(sequence_parallel_size=...)); make them equal"
        )
    tp = ((raw.get("tensor_parallel") or {}).get("autotp_size") or 1) if isinstance(raw, dict) else 1
    if tp > 1:
        raise NotImplementedError(
            f"initialize: tensor_parallel.autotp_size={tp} with the mpu of register_with_transformers; its "
            "sequence groups assume no tensor parallelism"
        )
    return {**raw, "sequence_parallel_size": size}


def _is_pipeline(model: object) -> bool:
    """A PipelineModule (checked without importing slipstream.pipe for other models)."""
    import sys

    pipe = sys.modules.get("slipstream.pipe.module")
    return pipe is not None and isinstance(model, pipe.PipelineModule)


def _engine_class(*, pipeline: bool) -> type[Any]:
    """DeepSpeed's engine selection: a PipelineModule gets the pipeline engine (the engine with a pipeline
    schedule, built by the engine's own steps)."""
    if pipeline:
        from slipstream.pipe.engine import PipelineEngine

        return PipelineEngine
    from slipstream.engine.engine import SlipstreamEngine

    return SlipstreamEngine


_TP_ATTRIBUTE = "_slipstream_tp_size"


def tp_model_init(model: nn.Module, tp_size: int, dtype: Any, config: Any = None, **kwargs: Any) -> nn.Module:
    """DeepSpeed's `tp_model_init`: record that `model` trains with tensor parallelism of `tp_size`; `initialize`
    splits it (as `tensor_parallel.autotp_size` would). `dtype` casts the model now; `config` and other
    arguments are accepted for DeepSpeed's signature (the config given to `initialize` is the one used)."""
    del config, kwargs
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_model_init(tp_size=...): expected an integer >= 1, got {tp_size!r}")
    if dtype is not None:
        model.to(dtype)
    setattr(model, _TP_ATTRIBUTE, tp_size)
    return model


def _with_recorded_tp(raw: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """`raw` with the TP size `tp_model_init` recorded; a different `tensor_parallel.autotp_size` is an error."""
    recorded = getattr(model, _TP_ATTRIBUTE, None)
    if recorded is None:
        return raw
    section = raw.get("tensor_parallel") or {}
    given = section.get("autotp_size", 0) if isinstance(section, dict) else 0
    if given not in (0, recorded):
        raise ValueError(
            f"tp_model_init(tp_size={recorded}) and the config's tensor_parallel.autotp_size={given} disagree; "
            "give one size (or the same in both)"
        )
    return {**raw, "tensor_parallel": {**section, "autotp_size": recorded}}

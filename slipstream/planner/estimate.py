"""`estimate()`: per-device and per-host bytes of every ZeRO option for one model and run shape.

The model states come from `zero_bytes` (the engine's own layout rules, checked against `owned_bytes()` by
tests/dist/planner), activations from `activations`, the model's shape from `shapes`. A DeepSpeed config is
resolved by `slipstream.config.resolve` (so "auto" and defaults mean what they mean to the engine) and gives
both the knobs of every row and a row of its own, labelled "config".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from slipstream.config.optimizers import is_muon_matrix
from slipstream.config.plan import RESIDENT_GRAD_SUB_GROUPS, NoOffloadTarget, nvme_gradients_in_files
from slipstream.planner.activations import transformer_activations
from slipstream.planner.shapes import Dims, ModelShape, from_factory, from_hf_config, from_module, synthetic
from slipstream.planner.types import (
    DTYPE_BYTES,
    STANDARD_OPTIONS,
    Option,
    OptionEstimate,
    Plan,
    Settings,
    offload_policy,
)
from slipstream.planner.zero_bytes import ZeroBytes, pinned_rounding, stage012_bytes, stage3_bytes


def estimate(
    *,
    params: float | None = None,
    model: object = None,
    hf_config: object = None,
    hidden: int | None = None,
    layers: int | None = None,
    seq: int | None = None,
    micro_batch: int | None = None,
    vocab: int | None = None,
    heads: int | None = None,
    gpus_per_node: int = 1,
    nodes: int = 1,
    dtype: str = "bf16",
    ds_config: object = None,
    options: Sequence[Option] | None = None,
    device_memory: int | None = None,
    host_memory: int | None = None,
    fused_attention: bool = False,
) -> Plan:
    """Bytes per device and per host of each option (default: `STANDARD_OPTIONS`).

    The model is `model` (an nn.Module, meta or real, or a "module:factory" string built on the meta device),
    else `hf_config` (a Hugging Face config dict or config.json path), else a synthetic decoder of `params`
    parameters shaped by `hidden`/`layers`/`vocab`. `ds_config` (dict or JSON path) sets the precision, bucket
    sizes, stage-3 knobs, optimizer and micro batch, and adds its own row first; without it `dtype` sets the
    parameter dtype and DeepSpeed's defaults apply. `device_memory` / `host_memory` (bytes) decide the fits flags
    and `Plan.cheapest`. `fused_attention` drops the attention-score term of the activation estimate (flash or
    memory-efficient attention keeps no seq x seq tensors).
    """
    if gpus_per_node < 1 or nodes < 1:
        raise ValueError(f"gpus_per_node and nodes must be >= 1, got {gpus_per_node} and {nodes}")
    world = gpus_per_node * nodes
    dims = Dims(hidden=hidden, layers=layers, heads=heads, vocab=vocab)
    shape = model_shape(params=params, model=model, hf_config=hf_config, dims=dims)
    settings, rows, config_micro = _settings_and_rows(
        ds_config, dtype=dtype, options=options, world=world, hidden=shape.dims.hidden
    )
    micro = micro_batch or config_micro
    notes = [f"model: {shape.source}, {shape.total:,} parameters ({shape.total - shape.frozen_numel:,} trainable)"]
    activations = _activations(
        shape.dims, seq=seq, micro_batch=micro, settings=settings, notes=notes, fused_attention=fused_attention
    )
    return _plan(
        shape,
        rows,
        settings=settings,
        gpus_per_node=gpus_per_node,
        nodes=nodes,
        activations=activations,
        device_memory=device_memory,
        host_memory=host_memory,
        notes=notes,
    )


def _plan(
    shape: ModelShape,
    rows: list[Option],
    *,
    settings: Settings,
    gpus_per_node: int,
    nodes: int,
    activations: tuple[int | None, int | None],
    device_memory: int | None,
    host_memory: int | None,
    notes: list[str],
) -> Plan:
    """Each row's estimate (`activations`: without and with checkpointing) and the cheapest row that fits."""
    estimates = [
        estimate_option(
            shape,
            option,
            settings=settings,
            world=gpus_per_node * nodes,
            gpus_per_node=gpus_per_node,
            activations=activations[0],
            activations_checkpointed=activations[1],
            device_memory=device_memory,
            host_memory=host_memory,
        )
        for option in rows
    ]
    cheapest, needs_ac = _cheapest(estimates, device_memory=device_memory, host_memory=host_memory)
    return Plan(
        total_params=shape.total,
        trainable_params=shape.total - shape.frozen_numel,
        world_size=gpus_per_node * nodes,
        gpus_per_node=gpus_per_node,
        nodes=nodes,
        settings=settings,
        estimates=tuple(estimates),
        device_memory=device_memory,
        host_memory=host_memory,
        cheapest=cheapest,
        cheapest_needs_checkpointing=needs_ac,
        notes=tuple(notes),
    )


def _settings_and_rows(
    ds_config: object, *, dtype: str, options: Sequence[Option] | None, world: int, hidden: int | None
) -> tuple[Settings, list[Option], int | None]:
    """(knobs, the options to estimate, the config's micro batch): the config's own row first when it gives one
    and `options` is not set."""
    settings, config_option, config_micro = Settings(dtype=dtype), None, None
    if ds_config is not None:
        settings, config_option, config_micro = settings_from_config(ds_config, world_size=world, hidden_size=hidden)
    rows = list(options) if options is not None else list(STANDARD_OPTIONS)
    if config_option is not None and options is None:
        rows.insert(0, config_option)
    return settings, rows, config_micro


def model_shape(*, params: float | None, model: Any, hf_config: Any, dims: Dims) -> ModelShape:
    if model is not None:
        return _with_dims(from_factory(model) if isinstance(model, str) else from_module(model), dims)
    if hf_config is not None:
        return _with_dims(from_hf_config(hf_config), dims)
    return synthetic(params=params, hidden=dims.hidden, layers=dims.layers, vocab=dims.vocab, heads=dims.heads)


def _with_dims(shape: ModelShape, dims: Dims) -> ModelShape:
    """Dimensions given explicitly win over those read from the model."""
    merged = Dims(**{f.name: getattr(dims, f.name) or getattr(shape.dims, f.name) for f in dataclasses.fields(Dims)})
    return dataclasses.replace(shape, dims=merged)


def settings_from_config(
    ds_config: object, *, world_size: int, hidden_size: int | None = None
) -> tuple[Settings, Option, int]:
    """(knobs, the config's own option, its micro batch) from a DeepSpeed config dict or JSON path."""
    from slipstream.config import load_config, resolve

    config = load_config(str(ds_config) if isinstance(ds_config, Path) else ds_config)
    plan = resolve(config, world_size=world_size, hidden_size=hidden_size)
    settings, option = settings_from_plan(plan)
    return settings, option, plan.batch.micro_batch_size


def settings_from_plan(plan: Any) -> tuple[Settings, Option]:
    """Knobs and option of an `EnginePlan` (what the engine will run)."""
    zero, precision = plan.zero, plan.precision
    stage3 = zero.stage3
    offload = zero.offload_optimizer
    optimizer = plan.optimizer
    settings = Settings(
        dtype=precision.param_dtype,
        grad_accum_dtype=precision.grad_accum_dtype,
        master_dtype=precision.master_dtype,
        reduce_dtype=zero.reduce_dtype,
        autocast=precision.autocast,
        overlap_comm=zero.overlap_comm,
        optimizer_state_dtype=precision.optimizer_state_dtype,
        reduce_bucket_size=int(zero.reduce_bucket_size),
        stage3=stage3 or Settings().stage3,
        # the configured pin_memory (True without offload); whether an option's buffers are pinned is its
        # optimizer policy's `pins_configured` (NVMe pins none)
        pin_memory=getattr(offload, "pin_memory", True),
        optimizer=optimizer.name if optimizer is not None else "adamw",
        optimizer_params=tuple(
            sorted(
                (k, v)
                for k, v in (optimizer.params if optimizer else {}).items()
                if k in ("amsgrad", "momentum", "centered")
            )
        ),
    )
    option = Option(
        stage=zero.stage,
        optimizer_target=type(offload),
        param_target=type(stage3.offload_param) if stage3 is not None else NoOffloadTarget,
        label="config",
    )
    return settings, option


def _activations(
    dims: Dims, *, seq: int | None, micro_batch: int | None, settings: Settings, notes: list[str], fused_attention: bool
) -> tuple[int | None, int | None]:
    missing = [
        name
        for name, value in (("seq", seq), ("hidden", dims.hidden), ("layers", dims.layers), ("heads", dims.heads))
        if not value
    ]
    if missing:
        notes.append(f"activations not estimated: give {', '.join('--' + m for m in missing)}")
        return None, None
    assert seq
    micro = micro_batch or 1
    if not micro_batch:
        notes.append("activations for micro batch 1 (give --micro-batch or a config)")
    return tuple(
        transformer_activations(  # type: ignore[return-value]
            dims,
            seq=seq,
            micro_batch=micro,
            dtype_bytes=DTYPE_BYTES[settings.dtype],
            fused_attention=fused_attention,
            checkpointing=checkpointing,
        )
        for checkpointing in (False, True)
    )


def estimate_option(
    shape: ModelShape,
    option: Option,
    *,
    settings: Settings,
    world: int,
    gpus_per_node: int,
    activations: int | None = None,
    activations_checkpointed: int | None = None,
    device_memory: int | None = None,
    host_memory: int | None = None,
) -> OptionEstimate:
    """One option's figures (model states from the engine's layout rules)."""
    settings = _with_muon_share(shape, settings)
    figures, init = _model_state_figures(shape, option, settings=settings, world=world)
    host, device = dict(figures.host), dict(figures.device)
    if offload_policy(option.optimizer_target).pins_configured(settings.pin_memory):
        host["pinned_rounding"] = pinned_rounding(figures.pinned_blocks)
    owned = dict(figures.owned)
    model_states = sum(
        owned[k] for k in ("params", "master", "grads", "optimizer_state", "host_buffers", "comm_buffers")
    )
    nvme = _move_to_nvme(option, settings=settings, host=host, device=device) if option.in_files else 0
    result = OptionEstimate(
        option=option,
        device=device,
        host=host,
        activations=activations,
        activations_checkpointed=activations_checkpointed,
        host_init_per_rank=init,
        model_states=model_states,
        owned=owned,
        gpus_per_node=gpus_per_node,
        nvme_per_rank=nvme,
    )
    fits_host = None if host_memory is None else result.host_total <= host_memory
    if device_memory is None:
        return dataclasses.replace(result, fits_host=fits_host)
    return dataclasses.replace(
        result,
        fits_device=result.device_total <= device_memory,
        fits_device_checkpointed=result.device_total_checkpointed <= device_memory,
        fits_host=fits_host,
    )


def _with_muon_share(shape: ModelShape, settings: Settings) -> Settings:
    """Muon keeps one state per element of its matrices and two elsewhere: the share of the trainable elements in
    Muon matrices (config/optimizers.py `is_muon_matrix`) goes to the registry's count as `muon_share`."""
    if settings.optimizer != "muon" or shape.module is None:
        return settings
    shapes = [
        (name, tuple(getattr(p, "ds_shape", None) or p.shape))
        for name, p in shape.module.named_parameters()
        if p.requires_grad
    ]  # stage 3's sharded parameters keep their layer shape in ds_shape
    total = sum(math.prod(dims) for _, dims in shapes)
    muon = sum(math.prod(dims) for name, dims in shapes if is_muon_matrix(name, dims))
    share = muon / total if total else 0.0
    params = tuple(kv for kv in settings.optimizer_params if kv[0] != "muon_share") + (("muon_share", share),)
    return dataclasses.replace(settings, optimizer_params=params)


def _model_state_figures(shape: ModelShape, option: Option, *, settings: Settings, world: int) -> tuple[ZeroBytes, int]:
    """(the option's model-state bytes, the host bytes one rank holds while building the model)."""
    if option.stage == 3:
        z3 = settings.stage3
        units = shape.units(
            z3.persistence_threshold, z3.leaf_classes, z3.leaf_names, z3.leaf_suffixes, autocast=settings.autocast
        )
        figures, _pool = stage3_bytes(
            units,
            world=world,
            settings=settings,
            offload=option.offload_optimizer,
            offload_param=option.offload_param,
            nvme_params=option.in_files,
        )
        largest_unit = max((sum(u.numels) for u in units), default=0)
        return figures, (largest_unit if settings.zero_init else shape.total) * 4
    figures = stage012_bytes(
        shape.trainable_numels,
        shape.frozen_numel,
        stage=option.stage,
        world=world,
        settings=settings,
        offload=option.offload_optimizer,
        reduce_dtypes=shape.trainable_reduce_dtypes(settings.autocast),
    )
    return figures, shape.total * 4


def _move_to_nvme(option: Option, *, settings: Settings, host: dict[str, int], device: dict[str, int]) -> int:
    """Take what an NVMe option swaps out of `host` (and `device`) in place; returns the bytes on NVMe per rank."""
    nvme = host.get("master", 0) + host.get("optimizer_state", 0) + host.get("offloaded_params", 0)
    host.pop("pinned_rounding", None)  # the row has no pinned figure (its policy pins nothing)
    host.pop("offloaded_params", None)  # parameter shards are read in per unit, not kept on the host
    if option.stage == 3:  # the step holds two sub-groups' masters and states (offload/nvme.py)
        resident = 2 * settings.stage3.sub_group_numel * DTYPE_BYTES[settings.master_dtype]
        share = min(1.0, resident / host["master"]) if host.get("master") else 1.0
        host["master"] = int(host["master"] * share)
        host["optimizer_state"] = int(host.get("optimizer_state", 0) * share)
        if settings.device_is_host and settings.grad_accum_dtype == settings.master_dtype and nvme_gradients_in_files():
            # the gradient shards are swapped per sub-group too (offload/grad_swap.py): a few in memory
            grad_bytes = DTYPE_BYTES[settings.grad_accum_dtype]
            held = (RESIDENT_GRAD_SUB_GROUPS + 2) * settings.stage3.sub_group_numel * grad_bytes  # bound
            nvme += device.get("grads", 0)
            device["grads"] = min(device.get("grads", 0), held)
    return nvme


def _cheapest(
    estimates: list[OptionEstimate], *, device_memory: int | None, host_memory: int | None
) -> tuple[str | None, bool]:
    """The cheapest option (`Option.cost_rank`) that fits; without checkpointing if any does."""
    if device_memory is None and host_memory is None:
        return None, False
    ranked = sorted(estimates, key=lambda e: (e.option.cost_rank, e.option.label != ""))
    for checkpointing in (False, True):
        for est in ranked:
            device_ok = est.fits_device_checkpointed if checkpointing else est.fits_device
            if (device_ok is None or device_ok) and (est.fits_host is None or est.fits_host):
                return est.option.name, checkpointing and est.activations is not None
    return None, False

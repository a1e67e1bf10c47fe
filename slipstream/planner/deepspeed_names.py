"""DeepSpeed's estimator functions, with DeepSpeed's names, signatures and printed table, and Slipstream's numbers.

DeepSpeed's versions (`deepspeed.runtime.zero.stage_1_and_2` / `stage3`) multiply the parameter count by
fixed factors. These evaluate the planner on the model (or, for the `_all_cold` variants, on a synthetic
decoder of `total_params` parameters): bf16 parameters, fp32 master weights, gradients and AdamW state,
DeepSpeed's default bucket sizes. What is printed:
- "per GPU": the device bytes of one rank without activations: parameters, gradients, master weights and
  optimizer state kept there, the communication buffers and, at stage 3, the gather pool and the gathered
  units' peak;
- "per CPU": one node's host bytes, the larger of the offloaded state of all its ranks and the model build
  (every rank builds the model in fp32, or one module at a time under zero.Init: `zero_init=1`), times
  `additional_buffer_factor` as in DeepSpeed.
The offload device is printed as "cpu" (DeepSpeed 0.19 prints "OffloadDeviceEnum.cpu"). Each function also
returns the `OptionEstimate`s it printed, in row order (DeepSpeed's return None).
"""

from __future__ import annotations

import math
from typing import Any

from slipstream.config.plan import CpuTarget, NoOffloadTarget
from slipstream.planner.estimate import estimate_option
from slipstream.planner.shapes import ModelShape, from_module, synthetic
from slipstream.planner.types import Option, OptionEstimate, Settings

GIB = 2**30


def _header(num_nodes: int, num_gpus_per_node: int, sw: str) -> None:
    nodes_str = "nodes" if num_nodes > 1 else "node"
    gpus_str = "GPUs" if num_gpus_per_node > 1 else "GPU"
    print(
        "Estimated memory needed for params, optim states and gradients for a:\n"
        f"HW: Setup with {num_nodes} {nodes_str}, {num_gpus_per_node} {gpus_str} per node.\n"
        f"SW: {sw}"
    )
    print("  per CPU  |  per GPU |   Options")


def _row(est: OptionEstimate, factor: float, options: str) -> None:
    cpu = est.host_total * factor
    gpu = sum(est.device.values())
    print(f" {cpu / GIB:7.2f}GB | {gpu / GIB:6.2f}GB | {options}")


def _zero2(shape: ModelShape, num_gpus_per_node: int, num_nodes: int, factor: float) -> list[OptionEstimate]:
    _header(num_nodes, num_gpus_per_node, f"Model with {int(shape.total / 1e6)}M total params.")
    rows = []
    for offload in (True, False):
        est = estimate_option(
            shape,
            Option(stage=2, optimizer_target=CpuTarget if offload else NoOffloadTarget),
            settings=Settings(device_is_host=False),  # DeepSpeed's formulas are for GPUs
            world=num_gpus_per_node * num_nodes,
            gpus_per_node=num_gpus_per_node,
        )
        _row(est, factor, f"offload_optimizer={'cpu ' if offload else 'none'}")
        rows.append(est)
    return rows


def _zero3(
    shape: ModelShape, largest_layer_params: int, num_gpus_per_node: int, num_nodes: int, factor: float
) -> list[OptionEstimate]:
    _header(
        num_nodes,
        num_gpus_per_node,
        f"Model with {int(shape.total / 1e6)}M total params, {int(largest_layer_params / 1e6)}M largest layer params.",
    )
    rows = []
    for offload, offload_param in ((True, True), (True, False), (False, False)):
        for zero_init in (True, False):
            est = estimate_option(
                shape,
                Option(
                    stage=3,
                    optimizer_target=CpuTarget if offload else NoOffloadTarget,
                    param_target=CpuTarget if offload_param else NoOffloadTarget,
                ),
                settings=Settings(zero_init=zero_init, device_is_host=False),
                world=num_gpus_per_node * num_nodes,
                gpus_per_node=num_gpus_per_node,
            )
            options = (
                f"offload_param={'cpu ' if offload_param else 'none'}, "
                f"offload_optimizer={'cpu ' if offload else 'none'}, zero_init={int(zero_init)}"
            )
            _row(est, factor, options)
            rows.append(est)
    return rows


def _largest_layer(model: Any) -> int:
    """DeepSpeed's "largest layer": the most parameters any one module holds directly."""
    return max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)


def estimate_zero2_model_states_mem_needs_all_live(
    model: object, num_gpus_per_node: int = 1, num_nodes: int = 1, additional_buffer_factor: float = 1.5
) -> list[OptionEstimate]:
    """Print the ZeRO-2 needs of `model` (an nn.Module, meta or real) with and without optimizer offload."""
    return _zero2(from_module(model), num_gpus_per_node, num_nodes, additional_buffer_factor)


def estimate_zero2_model_states_mem_needs_all_cold(
    total_params: float, num_gpus_per_node: int = 1, num_nodes: int = 1, additional_buffer_factor: float = 1.5
) -> list[OptionEstimate]:
    """Print the ZeRO-2 needs of a hypothetical model of `total_params` parameters (a synthetic decoder)."""
    return _zero2(
        synthetic(params=total_params, hidden=None, layers=None, vocab=None, heads=None),
        num_gpus_per_node,
        num_nodes,
        additional_buffer_factor,
    )


def estimate_zero3_model_states_mem_needs_all_live(
    model: object, num_gpus_per_node: int = 1, num_nodes: int = 1, additional_buffer_factor: float = 1.5
) -> list[OptionEstimate]:
    """Print the ZeRO-3 needs of `model` for each offload choice, with and without zero.Init."""
    shape = from_module(model)
    return _zero3(shape, _largest_layer(model), num_gpus_per_node, num_nodes, additional_buffer_factor)


def estimate_zero3_model_states_mem_needs_all_cold(
    total_params: float,
    largest_layer_params: float,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    additional_buffer_factor: float = 1.5,
) -> list[OptionEstimate]:
    """Print the ZeRO-3 needs of a hypothetical model: a synthetic decoder of `total_params` parameters whose
    largest matrix (hidden x 4 hidden) has `largest_layer_params` elements."""
    hidden = max(64, round(math.sqrt(max(float(largest_layer_params), 1.0) / 4) / 64) * 64)
    shape = synthetic(params=total_params, hidden=hidden, layers=None, vocab=None, heads=None)
    return _zero3(shape, int(largest_layer_params), num_gpus_per_node, num_nodes, additional_buffer_factor)


__all__ = [
    "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero2_model_states_mem_needs_all_live",
    "estimate_zero3_model_states_mem_needs_all_cold",
    "estimate_zero3_model_states_mem_needs_all_live",
]

"""`slipstream plan --cluster`: the communication model's tables (planner/comm_model.py) and their inputs.

Owns what the command prints: per variant, every collective with the bytes one rank sends inside and across
nodes and its time, then compute, the communication hidden behind it, the step time and the MFU reached; with
`--compare`, one summary row per variant side by side.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from slipstream.planner.cluster import Cluster
from slipstream.planner.comm_model import StepModel, Variant, step_model

_GIB = 2**30


def _gib(value: float) -> str:
    return f"{value / _GIB:.2f}"


def model_steps(
    variants: Sequence[Variant],
    *,
    numel: float,
    tokens_per_gpu: float,
    micro_steps: int,
    cluster: Cluster,
    param_bytes: int,
    grad_bytes: int,
) -> list[StepModel]:
    return [
        step_model(
            v,
            numel=numel,
            tokens_per_gpu=tokens_per_gpu,
            micro_steps=micro_steps,
            cluster=cluster,
            param_bytes=param_bytes,
            grad_bytes=grad_bytes,
        )
        for v in variants
    ]


def _heading(cluster: Cluster, numel: float, tokens_per_gpu: float) -> str:
    return (
        f"{numel / 1e9:.2f}B params, {tokens_per_gpu:g} tokens per GPU per step; {cluster.nodes} nodes x "
        f"{cluster.gpus_per_node} GPUs, {cluster.intra_bandwidth / 1e9:g} GB/s per GPU in a node, "
        f"{cluster.inter_bandwidth / 1e9:g} GB/s per node across, {cluster.flops / 1e12:g} TFLOP/s per GPU at "
        f"MFU {cluster.mfu:g}"
    )


def format_detail(model: StepModel) -> str:
    """One variant: each collective (per micro step unless marked), then the step's totals."""
    lines = [
        f"{model.variant.name}:",
        f"  {'phase':<9} {'collective':<15} {'of':<16} {'buffer GiB':>10} "
        f"{'intra GiB':>10} {'inter GiB':>10} {'seconds':>9}",
    ]
    for t in model.transfers:
        note = "" if t.per_micro else " (once per step)"
        lines.append(
            f"  {t.phase:<9} {t.op:<15} {t.what:<16} {_gib(t.buffer):>10} {_gib(t.intra):>10} "
            f"{_gib(t.inter):>10} {t.seconds:>9.3f}{note}"
        )
    lines.append(_summary(model))
    return "\n".join(lines)


def _summary(model: StepModel) -> str:
    extra = f", hpZ secondary copy {_gib(model.extra_memory)} GiB per rank" if model.extra_memory else ""
    return (
        f"  compute {model.compute:.3f} s, communication {model.comm:.3f} s of which {model.hidden:.3f} s "
        f"hidden, step {model.step:.3f} s, MFU {model.mfu:.3f}{extra}"
    )


def format_compare(models: Sequence[StepModel]) -> str:
    """Every variant side by side: bytes sent per rank per step, times, MFU and the speed-up over ZeRO-3."""
    base = next((m.step for m in models if m.variant.name == "zero3"), models[0].step)
    lines = [
        f"{'variant':<12} {'intra GiB':>10} {'inter GiB':>10} {'comm s':>8} {'hidden s':>9} {'compute s':>10} "
        f"{'step s':>8} {'MFU':>6} {'vs zero3':>9} {'extra GiB':>10}"
    ]
    for m in models:
        lines.append(
            f"{m.variant.name:<12} {_gib(sum(t.intra for t in m.transfers)):>10} "
            f"{_gib(sum(t.inter for t in m.transfers)):>10} {m.comm:>8.3f} {m.hidden:>9.3f} "
            f"{m.compute:>10.3f} {m.step:>8.3f} {m.mfu:>6.3f} {base / m.step:>8.2f}x "
            f"{_gib(m.extra_memory):>10}"
        )
    return "\n".join(lines)


def format_cluster_plan(
    models: Sequence[StepModel], *, cluster: Cluster, numel: float, tokens_per_gpu: float, compare: bool
) -> str:
    body = format_compare(models) if compare else "\n".join(format_detail(m) for m in models)
    return f"{_heading(cluster, numel, tokens_per_gpu)}\n{body}"


def cluster_json(models: Sequence[StepModel], *, cluster: Cluster, numel: float, tokens_per_gpu: float) -> str:
    head: Mapping[str, object] = {
        "params": numel,
        "tokens_per_gpu": tokens_per_gpu,
        "nodes": cluster.nodes,
        "gpus_per_node": cluster.gpus_per_node,
        "mfu": cluster.mfu,
    }
    return json.dumps({**head, "variants": [m.to_dict() for m in models]}, indent=2)

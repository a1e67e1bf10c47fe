"""A `Plan` as text tables, JSON, or a stacked bar chart (matplotlib, optional)."""

from __future__ import annotations

import json

from slipstream.planner.types import Plan, Settings

GIB = 2**30
_W = 10
DEVICE_COLUMNS = (  # (label, the device roles it sums); also the engine's start-up line (engine_hooks.py)
    ("params", ("params", "frozen_params")),
    ("grads", ("grads",)),
    ("master", ("master",)),
    ("optim", ("optimizer_state",)),
    ("comm+gather", ("comm_buffers", "gathered_params")),
    ("transient", ("transient",)),
)
_HOST_COLUMNS = (
    ("master", ("master",)),
    ("optim", ("optimizer_state",)),
    ("buffers", ("host_buffers",)),
    ("params", ("offloaded_params",)),
    ("pinned+", ("pinned_rounding",)),
)


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / GIB:.2f}"


def _fits(value: bool | None) -> str:
    return "?" if value is None else "yes" if value else "no"


def _autocast_words(settings: Settings) -> str:
    """torch_autocast's safe modules, whose gradients are reduced in its dtype (the comm buffers hold both)."""
    autocast = settings.autocast
    if autocast is None or not autocast.safe_modules:
        return ""
    classes = ", ".join(path.rpartition(".")[2] for path in autocast.safe_modules)
    return (
        f", torch_autocast {autocast.dtype or 'device default'}: gradients of {classes} reduced in it, "
        f"the rest in {settings.comm_dtype}"
    )


def format_plan(plan: Plan) -> str:
    """Two tables (per device, per host) with one row per option; the cheapest fitting option is marked '*'."""
    s = plan.settings
    title = (
        f"slipstream plan: {plan.total_params:,} parameters ({plan.trainable_params:,} trainable), "
        f"{plan.world_size} ranks ({plan.nodes} node(s) x {plan.gpus_per_node}), params {s.dtype}, "
        f"master {s.master_dtype}, grad accumulation {s.grad_accum_dtype}, optimizer {s.optimizer}"
        f"{_autocast_words(s)}"
    )
    lines = [title]
    limits = [
        f"device {plan.device_memory / 1e9:.1f} GB = {_gib(plan.device_memory)} GiB" if plan.device_memory else "",
        f"host {plan.host_memory / 1e9:.1f} GB = {_gib(plan.host_memory)} GiB" if plan.host_memory else "",
    ]
    if any(limits):
        lines.append("memory given: " + ", ".join(x for x in limits if x))
    width = max(len(e.option.name) for e in plan.estimates) + 2
    head = [name for name, _ in DEVICE_COLUMNS] + ["activ", "activ-ckpt", "total", "total-ckpt", "fits"]
    lines += ["", "per device (GiB, each rank)", f"{'option':<{width}}" + " ".join(f"{h:>{_W}}" for h in head)]
    for est in plan.estimates:
        mark = "*" if est.option.name == plan.cheapest else " "
        cells = [_gib(sum(est.device.get(r, 0) for r in roles)) for _, roles in DEVICE_COLUMNS]
        fits = _fits(est.fits_device)
        if est.fits_device is False and est.fits_device_checkpointed:
            fits = "ckpt"
        cells += [
            _gib(est.activations),
            _gib(est.activations_checkpointed),
            _gib(est.device_total),
            _gib(est.device_total_checkpointed),
            fits,
        ]
        lines.append(f"{mark}{est.option.name:<{width - 1}}" + " ".join(f"{c:>{_W}}" for c in cells))
    head = [name for name, _ in _HOST_COLUMNS] + ["build", "node total", "fits", "nvme/rank"]
    lines += [
        "",
        f"per host (GiB; roles per rank, totals for {plan.gpus_per_node} rank(s) per node)",
        f"{'option':<{width}}" + " ".join(f"{h:>{_W}}" for h in head),
    ]
    for est in plan.estimates:
        mark = "*" if est.option.name == plan.cheapest else " "
        cells = [_gib(sum(est.host.get(r, 0) for r in roles)) for _, roles in _HOST_COLUMNS]
        cells += [
            _gib(est.host_init_per_rank),
            _gib(est.host_total),
            _fits(est.fits_host),
            _gib(est.nvme_per_rank) if est.option.in_files else "-",
        ]
        lines.append(f"{mark}{est.option.name:<{width - 1}}" + " ".join(f"{c:>{_W}}" for c in cells))
    lines.append("")
    if plan.cheapest is not None:
        how = " with activation checkpointing" if plan.cheapest_needs_checkpointing else ""
        lines.append(f"cheapest option that fits: {plan.cheapest}{how} (marked *)")
    elif plan.device_memory or plan.host_memory:
        lines.append("no option fits the memory given")
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def plan_json(plan: Plan) -> str:
    return json.dumps(plan.to_dict(), indent=2, sort_keys=False)


def draw_png(plan: Plan, path: str) -> str | None:
    """Stacked bars per option (device roles + activations, host roles); the reason it was skipped, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "--png needs matplotlib, which is not installed (pip install 'slipstream[plot]'); no chart written"
    names = [e.option.name for e in plan.estimates]
    figure, (device_axis, host_axis) = plt.subplots(1, 2, figsize=(max(10, 1.3 * len(names)), 5))
    device_parts: list[tuple[str, list[float]]] = [
        (label, [sum(e.device.get(r, 0) for r in roles) / GIB for e in plan.estimates])
        for label, roles in DEVICE_COLUMNS
    ]
    device_parts.append(("activations", [(e.activations or 0) / GIB for e in plan.estimates]))
    host_parts = [
        (label, [sum(e.host.get(r, 0) for r in roles) * e.gpus_per_node / GIB for e in plan.estimates])
        for label, roles in _HOST_COLUMNS
    ]
    for axis, parts, title, limit in (
        (device_axis, device_parts, "per device (GiB)", plan.device_memory),
        (host_axis, host_parts, "per host (GiB)", plan.host_memory),
    ):
        bottom = [0.0] * len(names)
        for label, values in parts:
            axis.bar(names, values, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, values)]
        if limit:
            axis.axhline(limit / GIB, color="black", linestyle="--", linewidth=1)
        axis.set_title(title)
        axis.tick_params(axis="x", rotation=60)
        axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return None

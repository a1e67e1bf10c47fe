"""The inverse question of the planner: the largest model of a given shape that fits a machine, per option.

`largest(...)` fixes the decoder's width (hidden, heads, vocabulary, sequence, micro batch) and searches the
layer count: for each option, the most layers whose figures fit the device memory, the host memory and the
NVMe space given (an option with no room for one layer has none). On the CPU accelerator (no device memory
given and `Settings.device_is_host`) the device and host figures share the host's memory, so they are added.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypedDict

from slipstream.planner.estimate import estimate
from slipstream.planner.types import Option, OptionEstimate, Plan

if TYPE_CHECKING:
    from typing_extensions import Unpack

_MAX_LAYERS = 1 << 20


class ShapeAndMachine(TypedDict, total=False):
    """The keyword arguments `largest` takes as `estimate` does and hands to it unchanged (their defaults are
    `estimate`'s): the rest of the decoder's shape and the machine."""

    heads: int | None
    vocab: int | None
    seq: int | None
    micro_batch: int | None
    gpus_per_node: int
    nodes: int
    dtype: str
    ds_config: object
    options: Sequence[Option] | None
    fused_attention: bool


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Largest:
    """One option's answer."""

    option: str
    layers: int
    """Most layers that fit (0: not even one)."""
    params: int
    """Parameters of that model (0 when none fits)."""
    bound: str
    """What one more layer would exceed: "device", "host", "nvme" (or "" when nothing bounds it)."""
    estimate: OptionEstimate | None


def _exceeds(
    est: OptionEstimate,
    *,
    device_memory: int | None,
    host_memory: int | None,
    nvme_free: int | None,
    shared: bool,
    checkpointing: bool,
) -> str:
    """The first resource `est` does not fit in, or "" when it fits."""
    device = est.device_total_checkpointed if checkpointing and est.activations_checkpointed else est.device_total
    if shared and host_memory is not None:  # one memory: the device roles are host memory too (and the model
        # built before the engine is the device's parameters, not a second copy)
        if est.gpus_per_node * max(device + sum(est.host.values()), est.host_init_per_rank) > host_memory:
            return "host"
    else:
        if device_memory is not None and device > device_memory:
            return "device"
        if host_memory is not None and est.host_total > host_memory:
            return "host"
    if nvme_free is not None and est.option.in_files and est.nvme_per_rank * est.gpus_per_node > nvme_free:
        return "nvme"
    return ""


def largest(
    *,
    hidden: int,
    device_memory: int | None = None,
    host_memory: int | None = None,
    nvme_free: int | None = None,
    checkpointing: bool = False,
    **shape_and_machine: Unpack[ShapeAndMachine],
) -> list[Largest]:
    """For each option (the standard rows, with the config's own first when `ds_config` is given), the largest
    decoder of this width that fits. At least one of the three resources must be given; the other keywords are
    `estimate`'s (`ShapeAndMachine`)."""
    if device_memory is None and host_memory is None and nvme_free is None:
        raise ValueError("give the machine: --device-memory, --host-memory and/or --nvme-free")

    cache: dict[int, Plan] = {}  # plans by layer count, each computed once

    def at(layers: int) -> Plan:
        if layers not in cache:
            cache[layers] = estimate(hidden=hidden, layers=layers, **shape_and_machine)
        return cache[layers]

    first = at(1)
    shared = device_memory is None and first.settings.device_is_host
    labels = [e.option.name for e in first.estimates]

    return [
        _search_option(
            label,
            index,
            at,
            device_memory=device_memory,
            host_memory=host_memory,
            nvme_free=nvme_free,
            shared=shared,
            checkpointing=checkpointing,
        )
        for index, label in enumerate(labels)
    ]


def _search_option(
    label: str,
    index: int,
    at: Callable[[int], Plan],
    *,
    device_memory: int | None,
    host_memory: int | None,
    nvme_free: int | None,
    shared: bool,
    checkpointing: bool,
) -> Largest:
    """The largest model for the option in row `index` of every plan `at(layers)` returns."""

    def failing(layers: int) -> str:
        return _exceeds(
            at(layers).estimates[index],
            device_memory=device_memory,
            host_memory=host_memory,
            nvme_free=nvme_free,
            shared=shared,
            checkpointing=checkpointing,
        )

    return _search(label, index, failing, at)


def _search(label: str, index: int, failing: Callable[[int], str], at: Callable[[int], Any]) -> Largest:
    """Doubling, then bisection, on the layer count (figures grow with the layers)."""
    if failing(1):
        return Largest(option=label, layers=0, params=0, bound=failing(1), estimate=None)
    good, bad = 1, 2
    while bad <= _MAX_LAYERS and not failing(bad):
        good, bad = bad, bad * 2
    if bad > _MAX_LAYERS:
        return Largest(option=label, layers=good, params=at(good).total_params, bound="", estimate=None)
    while bad - good > 1:
        middle = (good + bad) // 2
        if failing(middle):
            bad = middle
        else:
            good = middle
    best = at(good)
    return Largest(
        option=label, layers=good, params=best.total_params, bound=failing(bad), estimate=best.estimates[index]
    )


def format_largest(answers: Sequence[Largest], *, hidden: int) -> str:
    """The table `slipstream plan --largest` prints, largest model first."""
    width = max([len("option")] + [len(a.option) for a in answers])
    lines = [f"largest model of width {hidden} per option (layers searched; activations included when known)"]
    lines.append(f"{'option':{width}} {'layers':>7} {'params':>10}  bound")
    for answer in sorted(answers, key=lambda a: -a.params):
        params = f"{answer.params / 1e9:.2f}B" if answer.params else "-"
        lines.append(f"{answer.option:{width}} {answer.layers:7d} {params:>10}  {answer.bound or '-'}")
    best = max(answers, key=lambda a: a.params, default=None)
    if best is not None and best.params:
        lines.append(f"largest: {best.params / 1e9:.2f}B parameters with {best.option}")
    return "\n".join(lines)

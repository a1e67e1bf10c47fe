"""The `compression_training` section read into frozen plans: what init_compression builds from.

The schema keeps each method free-form; this module reads the parts Slipstream builds (weight and activation
quantization, l1 and topk sparse pruning, row and head pruning of nn.Linear modules, channel pruning of nn.Conv2d modules) with
DeepSpeed's defaults, rejects values it cannot act on, and names every sub-option it does not build (they are
reported, never silently ignored).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slipstream.config.notices import notice

__all__ = [
    "ActivationPlan",
    "CompressionPlan",
    "GroupPlan",
    "LayerReductionPlan",
    "MethodPlan",
    "PruningPlan",
    "QuantizationPlan",
    "StructuredPlan",
    "resolve_compression",
]

_REDUCTION_KEYS = {"enabled", "keep_number_layer", "module_name_prefix", "teacher_layer", "other_module_name"}
STRUCTURED = ("row_pruning", "head_pruning", "channel_pruning")
"""The pruning methods that mask whole units (rows, heads, channels) and that redundancy_clean removes."""
_STRUCTURED_METHODS = {"row_pruning": ("l1", "topk"), "head_pruning": ("topk",), "channel_pruning": ("l1", "topk")}
_QUANT_SHARED = {
    "enabled",
    "quantizer_kernel",
    "schedule_offset",
    "quantize_groups",
    "quantization_type",
    "quantize_weight_in_forward",
    "rounding",
    "fp16_mixed_quantize",
}
_PRUNE_SHARED = {"enabled", "method", "schedule_offset"}
_ACTIVATION_SHARED = {"enabled", "quantization_type", "range_calibration", "schedule_offset"}


@dataclass(frozen=True)
class GroupPlan:
    """One entry of `different_groups`: module-name patterns (regular expressions) and their parameters."""

    name: str
    modules: tuple[str, ...]
    start_bits: int
    target_bits: int
    quantization_period: int
    dense_ratio: float
    bits: int
    """activation_quantization: the width of the inputs (4 or 8)."""
    related_modules: tuple[tuple[str, ...], ...] | None
    """Per entry of `modules`, the patterns of the layers that read its output (redundancy_clean shrinks their
    inputs with it); None when the group gives none."""


@dataclass(frozen=True)
class MethodPlan:
    """What every compression method has: the step it starts at and its groups of layers."""

    schedule_offset: int
    """The training step from which the method acts (counted by compression_scheduler)."""
    different_groups: tuple[GroupPlan, ...]


@dataclass(frozen=True)
class QuantizationPlan(MethodPlan):
    """`weight_quantization`: fake-quantized weights from `schedule_offset` on, bits stepping per group."""

    groups: int
    symmetric: bool
    stochastic: bool
    in_forward: bool


@dataclass(frozen=True)
class ActivationPlan(MethodPlan):
    """`activation_quantization`: the inputs of the matched layers fake-quantized at each group's `bits` from
    `schedule_offset` on."""

    symmetric: bool
    static: bool
    """range_calibration static: a running min/max kept in the layer; dynamic: each input's own range."""


@dataclass(frozen=True)
class PruningPlan(MethodPlan):
    """`sparse_pruning`: a mask keeping `dense_ratio` of each weight's elements."""

    method: str
    """"l1": fixed from |w| when init_compression runs; "topk": learned scores, one per element."""


@dataclass(frozen=True)
class StructuredPlan(MethodPlan):
    """`row_pruning`, `head_pruning` or `channel_pruning`: whole units masked from `schedule_offset` on."""

    name: str
    method: str
    """"l1": a fixed mask of the units with the largest L1 norms; "topk": a mask of learned scores."""
    num_heads: int
    """head_pruning: the attention heads of the output projection's input (0 for the other methods)."""


@dataclass(frozen=True)
class LayerReductionPlan:
    """`layer_reduction`: the student's layers `<prefix>.0 .. <prefix>.k-1` start as the teacher's `teacher_layer`
    (k = keep_number_layer of them); the modules named in `other_module_name` start as the teacher's too."""

    keep_number_layer: int
    module_name_prefix: str
    teacher_layer: tuple[int, ...]
    other_module_name: tuple[str, ...]


@dataclass(frozen=True)
class CompressionPlan:
    """The methods init_compression applies; None (or absent from `structured`) where the method is off."""

    quantization: QuantizationPlan | None
    activation: ActivationPlan | None
    pruning: PruningPlan | None
    structured: tuple[StructuredPlan, ...]
    layer_reduction: LayerReductionPlan | None


def _report(key: str, what: str) -> None:
    notice(
        f"compression_training.{key}",
        f"compression_training.{key}: {what}; Slipstream does not build it and ignores it (docs/compression.md)",
        rank=0,
    )


def _groups(method: str, section: dict[str, Any], known: set[str]) -> tuple[GroupPlan, ...]:
    out = []
    for name, group in (section.get("different_groups") or {}).items():
        params = dict(group.get("params") or {})
        for key in sorted(set(params) - known):
            _report(f"{method}.different_groups.{name}.params.{key}", f"set to {params[key]!r}")
        modules = group.get("modules") or ["*"]
        if not isinstance(modules, list):
            raise ValueError(
                f"compression_training.{method}.different_groups.{name}.modules is {modules!r}: "
                'give a list of module-name patterns, e.g. ["attention.self"]'
            )
        related = _related(method, name, group.get("related_modules"), len(modules))
        out.append(
            GroupPlan(
                name=name,
                modules=tuple(".*" if m == "*" else str(m) for m in modules),
                start_bits=int(params.get("start_bits", 8)),
                target_bits=int(params.get("target_bits", 8)),
                quantization_period=int(params.get("quantization_period", 1)),
                dense_ratio=float(params.get("dense_ratio", 0.1)),
                bits=int(params.get("bits", 0)),
                related_modules=related,
            )
        )
    return tuple(out)


def _related(method: str, name: str, related: object, count: int) -> tuple[tuple[str, ...], ...] | None:
    """`related_modules`: one list of patterns per entry of `modules` (DeepSpeed's layout), or None."""
    if related is None:
        return None
    if method not in STRUCTURED:
        _report(f"{method}.different_groups.{name}.related_modules", "only row, head and channel pruning use it")
        return None
    if not isinstance(related, list) or len(related) != count or not all(isinstance(r, list) for r in related):
        raise ValueError(
            f"compression_training.{method}.different_groups.{name}.related_modules is {related!r}: give one "
            f'list of module-name patterns per entry of modules ({count}), e.g. [["fc2"]]'
        )
    return tuple(tuple(".*" if m == "*" else str(m) for m in entry) for entry in related)


def _check_bits(group: GroupPlan) -> None:
    if not 3 <= group.target_bits <= group.start_bits:
        raise ValueError(
            f"compression_training.weight_quantization.different_groups.{group.name}: start_bits "
            f"{group.start_bits}, target_bits {group.target_bits}; need 3 <= target_bits <= start_bits "
            "(ternary and binary weights, 2 and 1 bits, are not built)"
        )
    if group.quantization_period < 1:
        raise ValueError(
            f"compression_training.weight_quantization.different_groups.{group.name}: "
            f"quantization_period {group.quantization_period}; give a period of at least 1 step"
        )


def _shared(method: str, section: dict[str, Any], known: set[str]) -> dict[str, Any] | None:
    """`method`'s shared_parameters when enabled (its keys outside `known` reported), else None."""
    shared = dict(section.get("shared_parameters") or {})
    if not shared.get("enabled", False):
        return None
    for key in sorted(set(shared) - known):
        _report(f"{method}.shared_parameters.{key}", f"set to {shared[key]!r}")
    return shared


def _quantization(section: dict[str, Any]) -> QuantizationPlan | None:
    shared = _shared("weight_quantization", section, _QUANT_SHARED)
    if shared is None:
        return None
    if shared.get("quantizer_kernel", False):
        _report(
            "weight_quantization.shared_parameters.quantizer_kernel",
            "the fused kernel (the PyTorch formula runs instead, same values)",
        )
    if (shared.get("fp16_mixed_quantize") or {}).get("enabled", False):
        _report("weight_quantization.shared_parameters.fp16_mixed_quantize", "mixing fp16 and quantized weights")
    kind, rounding = shared.get("quantization_type", "symmetric"), shared.get("rounding", "nearest")
    if kind not in ("symmetric", "asymmetric") or rounding not in ("nearest", "stochastic"):
        raise ValueError(
            f"compression_training.weight_quantization: quantization_type {kind!r}, rounding "
            f"{rounding!r}; use symmetric/asymmetric and nearest/stochastic"
        )
    groups = _groups("weight_quantization", section, {"start_bits", "target_bits", "quantization_period"})
    for group in groups:
        _check_bits(group)
    return QuantizationPlan(
        schedule_offset=int(shared.get("schedule_offset", 0)),
        groups=int(shared.get("quantize_groups", 1)),
        symmetric=kind == "symmetric",
        stochastic=rounding == "stochastic",
        in_forward=bool(shared.get("quantize_weight_in_forward", False)),
        different_groups=groups,
    )


def _pruning(section: dict[str, Any]) -> PruningPlan | None:
    shared = _shared("sparse_pruning", section, _PRUNE_SHARED)
    if shared is None:
        return None
    method = shared.get("method", "l1")
    if method not in ("l1", "topk"):
        _report("sparse_pruning.shared_parameters.method", f"method {method!r} (l1 and topk are built)")
        return None
    groups = _groups("sparse_pruning", section, {"dense_ratio"})
    for group in groups:
        _check_ratio("sparse_pruning", group)
    return PruningPlan(method=method, schedule_offset=int(shared.get("schedule_offset", 1000)), different_groups=groups)


def _activation(section: dict[str, Any]) -> ActivationPlan | None:
    shared = _shared("activation_quantization", section, _ACTIVATION_SHARED)
    if shared is None:
        return None
    kind, calibration = shared.get("quantization_type", "symmetric"), shared.get("range_calibration", "dynamic")
    if kind not in ("symmetric", "asymmetric") or calibration not in ("dynamic", "static"):
        raise ValueError(
            f"compression_training.activation_quantization: quantization_type {kind!r}, range_calibration "
            f"{calibration!r}; use symmetric/asymmetric and dynamic/static"
        )
    groups = _groups("activation_quantization", section, {"bits"})
    for group in groups:
        if group.bits not in (4, 8):
            raise ValueError(
                f"compression_training.activation_quantization.different_groups.{group.name}.params.bits is "
                f"{group.bits or 'missing'}; give 4 or 8 (the activation widths DeepSpeed builds)"
            )
    return ActivationPlan(
        schedule_offset=int(shared.get("schedule_offset", 1000)),
        symmetric=kind == "symmetric",
        static=calibration == "static",
        different_groups=groups,
    )


def _structured(method: str, section: dict[str, Any]) -> StructuredPlan | None:
    shared = _shared(method, section, {"enabled", "method", "schedule_offset", "num_heads"})
    if shared is None:
        return None
    kind, allowed = shared.get("method", _default_method(method)), _STRUCTURED_METHODS[method]
    heads = int(shared.get("num_heads", 0)) if method == "head_pruning" else 0
    if kind not in allowed or (method == "head_pruning" and heads < 1):
        raise ValueError(
            f"compression_training.{method}.shared_parameters: method {kind!r}, num_heads "
            f"{shared.get('num_heads')!r}; use method {' or '.join(allowed)}"
            + (" and give num_heads, the heads of the output projection's input" if method == "head_pruning" else "")
        )
    groups = _groups(method, section, {"dense_ratio"})
    for group in groups:
        _check_ratio(method, group)
    return StructuredPlan(
        name=method,
        method=kind,
        schedule_offset=int(shared.get("schedule_offset", 1000)),
        num_heads=heads,
        different_groups=groups,
    )


def _default_method(method: str) -> str:
    """DeepSpeed's default method: topk for head pruning (its only one), l1 otherwise."""
    return _STRUCTURED_METHODS[method][0]


def _check_ratio(method: str, group: GroupPlan) -> None:
    if not 0.0 < group.dense_ratio <= 1.0:
        raise ValueError(
            f"compression_training.{method}.different_groups.{group.name}: dense_ratio "
            f"{group.dense_ratio}; give the kept fraction in (0, 1]"
        )


def _layer_reduction(section: dict[str, Any]) -> LayerReductionPlan | None:
    if not section.get("enabled", False):
        return None
    for key in sorted(set(section) - _REDUCTION_KEYS):
        _report(f"layer_reduction.{key}", f"set to {section[key]!r}")
    teacher, keep = section.get("teacher_layer"), section.get("keep_number_layer")
    prefix, others = section.get("module_name_prefix"), section.get("other_module_name") or []
    if not isinstance(teacher, list) or keep != len(teacher) or not isinstance(prefix, str) or not prefix:
        raise ValueError(
            f"compression_training.layer_reduction: keep_number_layer {keep!r}, teacher_layer {teacher!r}, "
            f"module_name_prefix {prefix!r}; give the student's layer count, that many teacher layer indices "
            'and the layers\' common prefix, e.g. 2, [1, 3], "encoder.layer"'
        )
    return LayerReductionPlan(
        keep_number_layer=int(keep),
        module_name_prefix=prefix,
        teacher_layer=tuple(int(i) for i in teacher),
        other_module_name=tuple(str(name) for name in others),
    )


def resolve_compression(config: dict[str, Any]) -> CompressionPlan:
    """The plan of a whole DeepSpeed config's `compression_training` section (absent: nothing compressed)."""
    section = dict(config.get("compression_training") or {})
    built = {"weight_quantization", "activation_quantization", "sparse_pruning", "layer_reduction", *STRUCTURED}
    for method in sorted(set(section) - built):
        _report(method, "an unknown compression method")
    structured = (_structured(method, section.get(method) or {}) for method in STRUCTURED)
    return CompressionPlan(
        quantization=_quantization(section.get("weight_quantization") or {}),
        activation=_activation(section.get("activation_quantization") or {}),
        pruning=_pruning(section.get("sparse_pruning") or {}),
        structured=tuple(plan for plan in structured if plan is not None),
        layer_reduction=_layer_reduction(section.get("layer_reduction") or {}),
    )

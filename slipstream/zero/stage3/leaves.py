"""ZeRO-3 leaf modules: which modules are marked as leaves, by class, by name or by name suffix (pure).

A leaf module is gathered whole when its forward starts and is never split into smaller units (units.py,
[Note: choosing units]); DeepSpeed's `deepspeed.utils` names for marking them live here. The mark is the
module attribute `_z3_leaf` (DeepSpeed's, so a model marked by either library reads the same).

A class is named by the class itself (its subclasses match too), by its `__name__` or by its fully
qualified name (`package.module.Qualname`). The `*_by_name` / `*_by_suffix` forms return the modules they
marked and the names or suffixes that matched nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from slipstream.config.schema.zero import DEFAULT_LEAF_MODULE_CLASSES

__all__ = [
    "apply_leaf_settings",
    "get_z3_leaf_modules",
    "leaf_matches",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "z3_leaf_parameter",
]

LEAF_PARAM_ATTR = "ds_z3_leaf_module"
"""Set on each parameter of a leaf unit when ZeRO-3 shards it (the leaf module it belongs to)."""


def qualified_class_name(module: nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def _class_matches(module: nn.Module, wanted: type | str) -> bool:
    if isinstance(wanted, type):
        return isinstance(module, wanted)
    return wanted in (type(module).__name__, qualified_class_name(module))


def _check_classes(function: str, classes: Sequence[type | str]) -> tuple[type | str, ...]:
    wanted = (classes,) if isinstance(classes, (str, type)) else tuple(classes)
    bad = [c for c in wanted if not isinstance(c, (type, str))]
    if bad:
        raise TypeError(f"{function}: leaf module classes must be classes or class names (str), got {bad!r}")
    return wanted


def _class_label(classes: Iterable[type | str]) -> list[str]:
    return sorted({c if isinstance(c, str) else f"{c.__module__}.{c.__qualname__}" for c in classes})


def _flag_classes(
    function: str, model: nn.Module, classes: Sequence[type | str], flag: bool, raise_if_not_found: bool
) -> list[nn.Module]:
    wanted = _check_classes(function, classes)
    found = [m for m in model.modules() if any(_class_matches(m, c) for c in wanted)]
    for module in found:
        module._z3_leaf = flag  # type: ignore[assignment]
    if not found and raise_if_not_found:
        raise ValueError(
            f"{function}: no module of class {_class_label(wanted)} in the model ({type(model).__name__}); "
            "check the classes, or pass raise_if_not_found=False"
        )
    return found


def set_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: Sequence[type | str], raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Mark the modules of `model` (itself included) that are instances of these classes as ZeRO-3 leaves;
    returns them. ValueError when none matches, unless `raise_if_not_found` is False."""
    return _flag_classes("set_z3_leaf_modules", model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: Sequence[type | str], raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Clear the leaf mark of the modules of these classes; returns them (the same matching and error as
    `set_z3_leaf_modules`)."""
    return _flag_classes("unset_z3_leaf_modules", model, leaf_module_classes, False, raise_if_not_found)


def set_z3_leaf_modules_by_name(
    model: nn.Module, module_names: Sequence[str], flag: bool = True, raise_if_not_found: bool = True
) -> tuple[list[nn.Module], list[str]]:
    """Set the leaf mark to `flag` on the modules with these qualified names (as `named_modules()` gives
    them; "" is `model`). Returns (the modules, the names that matched none); ValueError when some name
    matched none, unless `raise_if_not_found` is False."""
    by_name = dict(model.named_modules())
    names = [module_names] if isinstance(module_names, str) else list(module_names)
    matched = [by_name[n] for n in names if n in by_name]
    missing = [n for n in names if n not in by_name]
    if missing and raise_if_not_found:
        raise ValueError(
            f"set_z3_leaf_modules_by_name: no module named {missing} in the model ({type(model).__name__}); "
            "names are those of model.named_modules(), e.g. 'layers.0.mlp'"
        )
    for module in matched:
        module._z3_leaf = flag  # type: ignore[assignment]
    return matched, missing


def set_z3_leaf_modules_by_suffix(
    model: nn.Module, module_name_suffixes: Sequence[str], flag: bool = True, raise_if_not_found: bool = True
) -> tuple[list[nn.Module], list[str]]:
    """Set the leaf mark to `flag` on every module whose qualified name ends with one of these suffixes.
    Returns (the modules, each once, the suffixes that matched none); ValueError when some suffix matched
    none, unless `raise_if_not_found` is False."""
    suffixes = [module_name_suffixes] if isinstance(module_name_suffixes, str) else list(module_name_suffixes)
    named = list(model.named_modules())
    matched: list[nn.Module] = []
    missing: list[str] = []
    for suffix in suffixes:
        hits = [m for n, m in named if n.endswith(suffix)]
        if not hits:
            missing.append(suffix)
        matched.extend(m for m in hits if not any(m is seen for seen in matched))
    if missing and raise_if_not_found:
        raise ValueError(
            f"set_z3_leaf_modules_by_suffix: no module name ends with {missing} in the model "
            f"({type(model).__name__}); check the suffixes, or pass raise_if_not_found=False"
        )
    for module in matched:
        module._z3_leaf = flag  # type: ignore[assignment]
    return matched, missing


def z3_leaf_module(module: nn.Module) -> bool:
    """True when `module` is marked as a ZeRO-3 leaf."""
    return bool(getattr(module, "_z3_leaf", False))


def z3_leaf_parameter(param: torch.Tensor) -> bool:
    """True when `param` was sharded by ZeRO-3 as part of a leaf module's unit."""
    return getattr(param, LEAF_PARAM_ATTR, None) is not None


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` (itself included) marked as ZeRO-3 leaves."""
    return [module for module in model.modules() if z3_leaf_module(module)]


def leaf_matches(
    model: nn.Module, classes: Sequence[str] = (), names: Sequence[str] = (), suffixes: Sequence[str] = ()
) -> tuple[list[tuple[str, nn.Module]], list[str]]:
    """The modules the `zero_optimization.leaf_module` settings name, in `named_modules()` order, without
    marking them; and the settings that matched nothing (DeepSpeed's default classes are never reported:
    they name Hugging Face MoE blocks most models do not have)."""
    found: list[tuple[str, nn.Module]] = []
    hit: set[str] = set()
    for name, module in model.named_modules():
        why = [f"class {c}" for c in classes if _class_matches(module, c)]
        why += [f"name {n}" for n in names if name == n]
        why += [f"suffix {s}" for s in suffixes if name.endswith(s)]
        if why:
            found.append((name, module))
            hit.update(why)
    wanted = [f"class {c}" for c in classes if c not in DEFAULT_LEAF_MODULE_CLASSES]
    wanted += [f"name {n}" for n in names] + [f"suffix {s}" for s in suffixes]
    return found, [w for w in wanted if w not in hit]


def apply_leaf_settings(
    model: nn.Module, classes: Sequence[str] = (), names: Sequence[str] = (), suffixes: Sequence[str] = ()
) -> list[nn.Module]:
    """Mark what the `zero_optimization.leaf_module` settings name; ValueError naming the settings that
    match no module of the model (a typo would otherwise silently change nothing)."""
    found, missing = leaf_matches(model, classes, names, suffixes)
    if missing:
        raise ValueError(
            f"zero_optimization.leaf_module: {', '.join(missing)} match no module of the model "
            f"({type(model).__name__}); classes are class names or package.module.Class, names and suffixes "
            "are those of model.named_modules(); fix them or remove them"
        )
    for _, module in found:
        module._z3_leaf = True  # type: ignore[assignment]
    return [module for _, module in found]

"""Checks `optimizer.params` / `scheduler.params` against the class they build, before it is built.

Names come from the class's constructor signature; each value's kind comes from the parameter's annotation
(our own classes) or its default (torch.optim classes, whose annotations mix in Tensor): a float default
takes a number, an int default an integer, a bool default true/false, a tuple default a list of that many
values. Ranges come from the parameter's name (`RANGES`). A value of the wrong kind or outside its range is a
ValueError naming the dotted key, the value and what is allowed, instead of training on `"0.0"` or failing
later with torch's `'<=' not supported between 'float' and 'str'`.
"""

from __future__ import annotations

import collections.abc
import inspect
import math
import types
import typing
from typing import Any

__all__ = ["RANGES", "check_params"]

_NUMBER, _INT, _BOOL, _STR, _NONE = "a number", "an integer", "true or false", "a string", "null"
_NUMBERS = "a list of numbers"

_NON_NEGATIVE = (
    "lr eps weight_decay momentum dampening lr_decay initial_accumulator_value alpha max_coeff min_coeff "
    "warmup_min_lr warmup_max_lr warmup_num_steps total_num_steps cycle_min_lr cycle_max_lr decay_lr_rate "
    "lr_range_test_min_lr lr_range_test_step_size lr_range_test_step_rate"
).split()
_UNIT_INTERVAL = ("rho", "warmup_min_ratio", "cos_min_ratio")

# name: (low, high, high is exclusive); both ends included otherwise
RANGES: dict[str, tuple[float, float, bool]] = {
    **{name: (0.0, math.inf, False) for name in _NON_NEGATIVE},
    **{name: (0.0, 1.0, False) for name in _UNIT_INTERVAL},
    "betas": (0.0, 1.0, True),
}


def check_params(section: str, cls: Any, params: dict[str, object], *, skip: int = 1) -> None:
    """Raise ValueError for the first value of `params` that `cls(<skip positional args>, **params)` would
    misread. Parameters the checker cannot type (no default, no simple annotation) are left to the class."""
    signature = inspect.signature(cls.__init__)
    hints = _hints(cls)
    parameters = list(signature.parameters.values())[1 + skip :]
    for param in parameters:
        if param.name not in params:
            continue
        kinds = _kinds(hints.get(param.name), param.default)
        if kinds:
            _check_value(f"{section}.params.{param.name}", params[param.name], kinds, param.name)


def _hints(cls: Any) -> dict[str, Any]:
    """Resolved annotations of `cls.__init__`, or {} when they cannot be resolved (then defaults decide)."""
    try:
        return typing.get_type_hints(cls.__init__)
    except Exception:
        return {}


def _kinds(hint: object, default: object) -> list[Any]:
    """What a config value may be: kind names, or lists of per-element kinds (a fixed-length sequence)."""
    if hint is not None:
        kinds = _kinds_of_hint(hint)
        if kinds:
            return kinds
    if default is inspect.Parameter.empty:
        return []
    return _kinds_of_value(default)


def _kinds_of_value(default: object) -> list[Any]:
    if isinstance(default, bool):
        return [_BOOL]
    if isinstance(default, (int, float)):
        return [_NUMBER]  # torch writes `momentum: float = 0`: an int default does not make an int parameter
    if isinstance(default, str):
        return [_STR]
    if isinstance(default, tuple) and default:
        return [[_kinds_of_value(item) or [_NUMBER, _NONE] for item in default]]
    return []  # None (torch's `foreach=None`, ...): one of several kinds, left to the class


def _kinds_of_hint(hint: object) -> list[Any]:
    """Kinds from an annotation; [] when some member cannot be checked. Tensor members are dropped: a JSON
    config cannot hold a tensor (torch allows Tensor learning rates)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or isinstance(hint, types.UnionType):
        found: list[Any] = []
        for arg in args:
            if getattr(arg, "__name__", "") == "Tensor":
                continue
            sub = _kinds_of_hint(arg)
            if not sub:
                return []
            found += sub
        return found
    if origin is tuple and args and Ellipsis not in args:
        return [[_kinds_of_hint(arg) or [_NUMBER, _NONE] for arg in args]]
    if (
        origin in (list, collections.abc.Sequence)
        and len(args) == 1
        and _kinds_of_hint(args[0]) in ([_NUMBER], [_INT], [_NUMBER, _INT], [_INT, _NUMBER])
    ):
        return [_NUMBERS]
    simple = {bool: _BOOL, int: _INT, float: _NUMBER, str: _STR, type(None): _NONE}
    return [simple[hint]] if hint in simple else []


def _matches(value: object, kind: object) -> bool:
    if isinstance(kind, list):
        return (
            isinstance(value, (list, tuple))
            and len(value) == len(kind)
            and all(any(_matches(v, k) for k in ks) for v, ks in zip(value, kind))
        )
    if kind == _NUMBERS:
        return isinstance(value, (list, tuple)) and all(_matches(v, _NUMBER) for v in value)
    if kind == _BOOL:
        return isinstance(value, bool)
    if kind == _INT:
        return (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer()
        )
    if kind == _NUMBER:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == _STR:
        return isinstance(value, str)
    return value is None


def _describe(kind: object) -> str:
    if isinstance(kind, list):
        return f"a list of {len(kind)} values ({', '.join(' or '.join(k) for k in kind)})"
    return str(kind)


def _check_value(key: str, value: object, kinds: list[object], name: str) -> None:
    if not any(_matches(value, kind) for kind in kinds):
        shown = [kind for kind in kinds if not (kind == _INT and _NUMBER in kinds)]  # a number covers integers
        allowed = " or ".join(_describe(kind) for kind in shown)
        hint = f" (a string; write {value} without quotes)" if isinstance(value, str) and _is_number(value) else ""
        raise ValueError(f"{key}: expected {allowed}, got {value!r}{hint}")
    if name not in RANGES:
        return
    low, high, open_high = RANGES[name]
    numbers = value if isinstance(value, (list, tuple)) else [value]
    for number in numbers:
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            continue
        if number < low or number > high or (open_high and number >= high):
            bound = f"< {high:g}" if open_high else f"<= {high:g}" if high != math.inf else ""
            allowed = f">= {low:g}" + (f" and {bound}" if bound else "")
            raise ValueError(f"{key}: {value!r} is out of range; each value must be {allowed}")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True

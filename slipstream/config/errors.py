"""ConfigError and the wording of config problems: unknown keys with a "did you mean", wrong types with the
expected type and what was given, and pydantic errors turned into one line per problem.

Every problem line starts with the dotted path of the key (`zero_optimization.stage3_prefetch_bucket_sz`).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import ValidationError

__all__ = ["ConfigError", "ConfigWarning", "describe", "dotted", "pydantic_problems", "unknown_key_problem"]


class ConfigError(ValueError, AssertionError):
    """A DeepSpeed config that cannot be used; `.problems` lists every problem found, one line each.

    Also an AssertionError: DeepSpeed checks much of its config (the batch triple, bucket alignment) with
    `assert`, and its callers catch that."""

    def __init__(self, problems: Sequence[str], *, header: str | None = None) -> None:
        self.problems: list[str] = list(problems)
        count = len(self.problems)
        head = header or (
            f"{count} problem in the DeepSpeed config" if count == 1 else f"{count} problems in the DeepSpeed config"
        )
        super().__init__(head + ":\n" + "\n".join(f"  - {p}" for p in self.problems))


class ConfigWarning(UserWarning):
    """A config key that is accepted but ignored (unknown key with strict false, deprecated spelling)."""


def dotted(loc: Iterable[object]) -> str:
    """("zero_optimization", "offload_optimizer", "device") -> "zero_optimization.offload_optimizer.device"
    (list positions become "[i]")."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "<top level>"


def describe(value: object) -> str:
    """How a JSON value reads in a message: "the string '8'", "the integer 8", "an object", ..."""
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, str):
        return f"the string {value!r}"
    if isinstance(value, int):
        return f"the integer {value}"
    if isinstance(value, float):
        return f"the number {value!r}"
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, (list, tuple)):
        return "a list"
    return f"a {type(value).__name__}"


def unknown_key_problem(path: str, key: str, valid: Iterable[str]) -> str:
    """ "<path>: unknown key; did you mean '<closest>'?" (or the list of valid keys when nothing is close)."""
    choices = sorted(set(valid))
    close = difflib.get_close_matches(key, choices, n=1, cutoff=0.6)
    close = close or sorted(c for c in choices if len(key) >= 3 and (c.startswith(key) or key.startswith(c)))
    if close:
        return f"{path}: unknown key; did you mean '{close[0]}'?"
    shown = ", ".join(choices[:12]) + (", ..." if len(choices) > 12 else "")
    return f"{path}: unknown key; valid keys here are: {shown}"


_EXPECTED = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "bool_type": "a boolean (true or false)",
    "bool_parsing": "a boolean (true or false)",
    "float_type": "a number",
    "float_parsing": "a number",
    "finite_number": "a finite number",
    "string_type": "a string",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
    "list_type": "a list",
}
_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


def _message(error: dict[str, Any]) -> str:
    kind, given, ctx = error["type"], error.get("input"), error.get("ctx") or {}
    if kind in _EXPECTED:
        return f"expected {_EXPECTED[kind]}, got {describe(given)}"
    if kind in _BOUNDS:
        bound = next(iter(ctx.values()), "?")
        return f"expected a number {_BOUNDS[kind]} {bound}, got {describe(given)}"
    if kind == "literal_error":
        return f"expected one of {ctx.get('expected', '?')}, got {describe(given)}"
    if kind == "missing":
        return "required key is missing"
    if kind == "value_error":
        return str(ctx.get("error", error["msg"]))
    if kind == "extra_forbidden":
        return "unknown key"
    return f"{error['msg']}, got {describe(given)}"


def pydantic_problems(exc: ValidationError, prefix: Sequence[object] = ()) -> list[str]:
    """One "<dotted path>: <what was expected>, got <what was given>" line per pydantic error."""
    problems = []
    for error in exc.errors():
        loc = [part for part in error["loc"] if not _is_union_tag(part)]
        problems.append(f"{dotted([*prefix, *loc])}: {_message(dict(error))}")
    return list(dict.fromkeys(problems))


def _is_union_tag(part: object) -> bool:
    """pydantic adds the member type ("int", "str", "function-before[...]") to the loc of union errors."""
    return isinstance(part, str) and (
        part in {"int", "str", "float", "bool", "dict[str,any]", "list[str]"}
        or part.startswith(("function-", "constrained-", "lax-", "json-"))
    )

"""Shared pieces of the DeepSpeed JSON schema: the strict base model and the number types.

Every section model derives from `DSModel`: unknown keys are forbidden, a field may be given by its
name or by its DeepSpeed alias, numbers and booleans are strict (the string "8" is not an integer),
and each field's docstring becomes its description. `IMPLEMENTED` lists the fields Slipstream acts
on; `slipstream.config.resolve` reports any other field set to a non-default value as unimplemented.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar

from pydantic import AliasChoices, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from slipstream.config.errors import ConfigError

__all__ = [
    "DSBool",
    "DSModel",
    "DSInt",
    "DSFloat",
    "OpenSection",
    "aliased",
    "accepted_keys",
    "model_of",
    "plan_fields",
    "zero_one",
]


def _integral_float_to_int(value: object) -> Any:
    """DeepSpeed writes sizes as floats (`5e8`); accept a float that is a whole number as an int."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


DSInt = Annotated[int, BeforeValidator(_integral_float_to_int)]
"""An integer; a float with no fractional part (`5e8`) is accepted and converted."""

DSFloat = float
"""A number (an int is accepted); strings and booleans are not."""


def zero_one(value: object) -> Any:
    """DeepSpeed reads its booleans leniently (pydantic's lax mode, or a plain truth test), and configs write
    `1` / `0` for true / false (`"zero_allow_untested_optimizer": 1`): the integers 0 and 1 become booleans.
    Other values are left to the strict check (the string "true" and 2 stay errors)."""
    if type(value) is int and value in (0, 1):
        return bool(value)
    return value


DSBool = Annotated[bool, BeforeValidator(zero_one)]
"""A boolean; the integers 0 and 1 are accepted as false and true (DeepSpeed accepts them)."""


class DSModel(BaseModel):
    """Base of every config section: strict, documented, and explicit about what Slipstream implements."""

    model_config = ConfigDict(
        extra="forbid", populate_by_name=True, strict=True, use_attribute_docstrings=True, frozen=True
    )
    IMPLEMENTED: ClassVar[Mapping[str, str]] = {}
    """Fields Slipstream honours, each with the `EnginePlan` field it becomes (a dotted path; "" for a key that
    acts inside resolve() itself). Every other field is accepted and reported as not implemented when set
    away from its default; an `enabled` field not listed here means the whole section is unimplemented when
    enabled. tests/unit/config/test_honoured.py checks that each plan field named here is read by a
    component."""
    LITERAL_AUTO: ClassVar[frozenset[str]] = frozenset()
    """Fields for which the string "auto" is a real DeepSpeed value (not an HF placeholder)."""

    def __init__(self, /, **data: object) -> None:
        # here as well as in the validator: an error raised inside validation becomes pydantic's ValidationError,
        # and DeepSpeed's callers catch the both-given case as AssertionError (ConfigError is one)
        super().__init__(**_migrate_deprecated(type(self), data))

    @model_validator(mode="before")
    @classmethod
    def _deprecated_fields(cls, data: object) -> Any:
        return _migrate_deprecated(cls, data) if isinstance(data, Mapping) else data


def _migrate_deprecated(model: type[BaseModel], data: Mapping[str, object]) -> dict[str, Any]:
    """DeepSpeedConfigModel's deprecated fields: a field declared with `json_schema_extra={"deprecated": True,
    "new_param": "name", "new_param_fn": f}` is moved to `name` (through `f`, when given) with a deprecation
    warning; giving both is an error."""
    out = dict(data)
    for name, info in model.model_fields.items():
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, Mapping) else {}
        if not extra.get("deprecated") or name not in out:
            continue
        new = extra.get("new_param")
        if not isinstance(new, str) or not new:
            warnings.warn(f"{model.__name__}: config key {name!r} is deprecated", DeprecationWarning, stacklevel=4)
            continue
        if new in out:
            raise ConfigError(
                [f"{new}: given together with {name!r}, its deprecated spelling ({model.__name__}); keep only {new!r}"]
            )
        value = out.pop(name)
        convert = extra.get("new_param_fn")
        out[new] = convert(value) if callable(convert) else value
        warnings.warn(
            f"{model.__name__}: config key {name!r} is deprecated; use {new!r}", DeprecationWarning, stacklevel=4
        )
    return out


class OpenSection(DSModel):
    """A section whose full key list Slipstream does not track: known keys are checked, others are kept."""

    model_config = ConfigDict(extra="allow")


def aliased(default: Any, *aliases: str, **kwargs: Any) -> Any:
    """A field also accepted under DeepSpeed alias names; the first alias is the JSON spelling written out."""
    return Field(
        default,
        validation_alias=AliasChoices(aliases[0], *aliases[1:]),
        serialization_alias=aliases[0],
        **kwargs,
    )


def plan_fields(plan: str, *fields: str, **elsewhere: str) -> dict[str, str]:
    """An `IMPLEMENTED` map: each of `fields` becomes the plan field `<plan>.<field>`; each keyword names its
    field's plan field outright (`enabled="logging.comms_log"`)."""
    return {**elsewhere, **{field: f"{plan}.{field}" for field in fields}}


def accepted_keys(model: type[BaseModel]) -> dict[str, str]:
    """Every key the model accepts in JSON (field names and aliases) mapped to its field name."""
    keys: dict[str, str] = {}
    for name, info in model.model_fields.items():
        keys[name] = name
        alias = info.validation_alias
        if isinstance(alias, AliasChoices):
            for choice in alias.choices:
                if isinstance(choice, str):
                    keys[choice] = name
        elif isinstance(alias, str):
            keys[alias] = name
    return keys


def model_of(annotation: object) -> type[DSModel] | None:
    """The DSModel class inside a field annotation (`X`, `Optional[X]`, `X | bool`), if there is one."""
    if isinstance(annotation, type) and issubclass(annotation, DSModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = model_of(arg)
        if found is not None:
            return found
    return None

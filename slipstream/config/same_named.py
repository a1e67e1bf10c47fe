"""`same_named`: a plan filled from a schema section's fields of the same names.

For plan classes that mirror a DeepSpeed section one to one (the section's `IMPLEMENTED` map is then mostly
`plan_fields(...)`, schema/base.py); a field whose value changes name or type is given as a keyword.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = ["same_named"]

P = TypeVar("P", bound="DataclassInstance")


def same_named(section: object, plan_class: type[P], **converted: Any) -> P:
    """`plan_class` filled from `section`'s attributes of the same names, `converted` where a value changes."""
    names = [field.name for field in dataclasses.fields(plan_class)]
    return plan_class(**{name: getattr(section, name) for name in names if name not in converted}, **converted)

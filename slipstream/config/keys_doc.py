"""The table of every DeepSpeed config key Slipstream accepts: its default, and whether it is honoured (with the
plan field it becomes) or reported as not implemented when set. docs/config-keys.md is this table; a test keeps
the two equal (`python -m slipstream.config.keys_doc > docs/config-keys.md` rewrites it)."""

from __future__ import annotations

import json

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from slipstream.config.keys import _json_key
from slipstream.config.schema.base import model_of
from slipstream.config.schema.top import DeepSpeedConfig

__all__ = ["render"]

_HEADER = """# DeepSpeed config keys in Slipstream

Generated from the schema (`python -m slipstream.config.keys_doc > docs/config-keys.md`; a test keeps it
current). **honoured**: the key becomes the named field of the resolved plan, which a component reads (a test
checks that). **reported**: accepted, and when set away from its default, named once (a warning, and a log
record on rank 0 that a warnings filter does not hide) with what the run does instead: it goes on as with
the key's default. A section marked *(section)* is honoured or reported as a whole through its keys below.
Unknown keys are errors naming the closest valid key.

| key | default | status |
|---|---|---|
"""


def _default(info: FieldInfo) -> str:
    value = info.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "*(section)*"
    try:
        text = json.dumps(value)
    except TypeError:
        text = str(value)
    return f"`{text}`" if len(text) <= 40 else f"`{text[:37]}...`"


def _rows(cls: type[BaseModel], prefix: str) -> list[str]:
    rows = []
    implemented = getattr(cls, "IMPLEMENTED", {})
    for name, info in cls.model_fields.items():
        key = prefix + _json_key(cls, name)
        sub = model_of(info.annotation)
        if name in implemented:
            target = implemented[name]
            status = f"honoured: `{target}`" if target else "honoured (read while resolving)"
        else:
            status = "reported"
        rows.append(f"| `{key}` | {'*(section)*' if sub is not None else _default(info)} | {status} |")
        if sub is not None:
            rows.extend(_rows(sub, key + "."))
    return rows


def render() -> str:
    return _HEADER + "\n".join(_rows(DeepSpeedConfig, "")) + "\n"


if __name__ == "__main__":
    print(render(), end="")

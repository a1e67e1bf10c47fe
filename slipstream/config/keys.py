"""Walks over config keys: the raw-dict pass before validation (unknown keys, HF "auto") and the pass after
it that lists what the user set but Slipstream does not implement yet.

The raw pass works on the user's JSON so that every message carries the path exactly as written. It returns a
cleaned copy: unknown keys dropped (each an error, or one warning with strict false), "auto" values replaced
or dropped. What "auto" becomes is documented in slipstream/config/resolve.py.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from slipstream.config.errors import ConfigWarning, dotted, unknown_key_problem
from slipstream.config.schema.base import DSModel, accepted_keys, model_of

__all__ = ["BATCH_KEYS", "KeyWalk", "unimplemented_keys"]

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_FREE_PARAMS = {("optimizer", "params"), ("scheduler", "params")}
_DROP = object()


def _hidden_size_rules(hidden: int) -> dict[str, int]:
    """Transformers' HfTrainerDeepSpeedConfig formulas, keyed by ZeroConfig field name."""
    return {
        "reduce_bucket_size": hidden * hidden,
        "prefetch_bucket_size": int(0.9 * hidden * hidden),
        "param_persistence_threshold": 10 * hidden,
    }


@dataclass
class KeyWalk:
    """One raw pass over a config; collects problems, warns for ignored keys, records what "auto" became."""

    strict: bool
    hidden_size: int | None
    problems: list[str] = field(default_factory=list)
    auto_batch: list[str] = field(default_factory=list)
    auto_filled: dict[str, int] = field(default_factory=dict)

    def clean(self, data: dict[str, object], model: type[DSModel], path: tuple[str, ...] = ()) -> dict[str, Any]:
        """A copy of `data` with unknown keys removed and "auto" handled, recursing into sub-sections."""
        keys = accepted_keys(model)
        out: dict[str, Any] = {}
        seen: dict[str, str] = {}
        for key, value in data.items():
            here = (*path, key)
            name = keys.get(key)
            if name is None and not path and key.partition(".")[0] in keys:
                self._dotted_top_level(key)
                continue
            if name is None:
                if model.model_config.get("extra") == "allow":
                    out[key] = value
                else:
                    self._unknown(here, keys, model)
                continue
            if name in seen:
                self.problems.append(f"{dotted(here)}: same setting as '{seen[name]}'; give only one of them")
                continue
            seen[name] = key
            value = self._value(value, here, name, model)
            if value is not _DROP:
                out[key] = value
        return out

    def _value(self, value: object, here: tuple[str, ...], name: str, model: type[DSModel]) -> Any:
        if here == ("zero_optimization",) and isinstance(value, bool):
            return self._legacy_zero_flag(value)
        if isinstance(value, str) and value == "auto":
            return value if name in model.LITERAL_AUTO else self._auto(here, name)
        if isinstance(value, dict):
            sub = model_of(model.model_fields[name].annotation)
            if sub is not None:
                return self.clean(value, sub, here)
            if here in _FREE_PARAMS:
                kept = {}
                for key, item in value.items():
                    if isinstance(item, str) and item == "auto":
                        self._auto((*here, key), key)
                    else:
                        kept[key] = item
                return kept
        return value

    def _legacy_zero_flag(self, value: bool) -> dict[str, int]:
        """DeepSpeed's legacy `"zero_optimization": true` (stage 1) / `false` (stage 0): easy to misread as
        "ZeRO on" (which stage?), so an error with the modern spelling, or one warning with strict false."""
        stage = 1 if value else 0
        message = (
            f"zero_optimization: {str(value).lower()} is DeepSpeed's legacy form of stage {stage}; write "
            f'"zero_optimization": {{"stage": {stage}}} (or the stage you meant)'
        )
        if self.strict:
            self.problems.append(message)
        else:
            warnings.warn(f"{message} (accepted because strict is false)", ConfigWarning, stacklevel=5)
        return {"stage": stage}

    def _dotted_top_level(self, key: str) -> None:
        """A top-level `"zero_optimization.reduce_bucket_size"` (TRL's `prepare_deepspeed` writes these into the
        config it passes to `deepspeed.initialize`): DeepSpeed reads only the nested sections, so the key has no
        effect there and is ignored here too, with a warning, strict or not."""
        section, _, rest = key.partition(".")
        warnings.warn(
            f"{key}: a dotted key at the top level of the config has no effect (as in DeepSpeed, which reads only "
            f'nested sections) and is ignored; to set it, write "{section}": {{"{rest}": ...}}',
            ConfigWarning,
            stacklevel=4,
        )

    def _unknown(self, here: tuple[str, ...], keys: dict[str, str], model: type[DSModel]) -> None:
        home = _section_holding(here[-1], model)
        if home is not None:
            message = f"{dotted(here)}: unknown key here; did you mean '{home}'?"
        else:
            message = unknown_key_problem(dotted(here), here[-1], keys)
        if self.strict:
            self.problems.append(message)
        else:
            warnings.warn(f"{message} (ignored because strict is false)", ConfigWarning, stacklevel=4)

    def _auto(self, here: tuple[str, ...], name: str) -> Any:
        """What an "auto" value becomes; _DROP when removed (with a problem recorded unless a batch key)."""
        key = dotted(here)
        if len(here) == 1 and name in BATCH_KEYS:
            self.auto_batch.append(name)
            return _DROP
        if len(here) == 2 and here[0] == "zero_optimization" and name in _hidden_size_rules(1):
            if self.hidden_size is None:
                self.problems.append(
                    f'{key}: "auto" needs the model\'s hidden size; pass hidden_size=... to resolve() or set a number'
                )
                return _DROP
            self.auto_filled[key] = _hidden_size_rules(self.hidden_size)[name]
            return self.auto_filled[key]
        self.problems.append(
            f'{key}: "auto" must be filled in by the caller (e.g. Transformers\' Trainer) or replaced with a value'
        )
        return _DROP


def _section_holding(key: str, model: type[DSModel], prefix: str = "", depth: int = 0) -> str | None:
    """The dotted place below `model` where `key` is valid (a key put at the wrong level), if there is one."""
    for name, info in model.model_fields.items():
        sub = model_of(info.annotation)
        if sub is None or depth > 2:
            continue
        here = f"{prefix}{_json_key(model, name)}"
        if key in accepted_keys(sub):
            return f"{here}.{key}"
        found = _section_holding(key, sub, f"{here}.", depth + 1)
        if found is not None:
            return found
    return None


def _json_key(model: type[BaseModel], name: str) -> str:
    alias = model.model_fields[name].serialization_alias
    return alias or name


def _is_default(model: type[BaseModel], name: str, value: object) -> bool:
    default = model.model_fields[name].get_default(call_default_factory=True)
    return value == default or (default is None and value == {})


def unimplemented_keys(section: BaseModel, path: str = "") -> list[str]:
    """Dotted keys set by the user (enabled, or not the default) that Slipstream does not act on yet."""
    cls = type(section)
    implemented: Mapping[str, str] = getattr(cls, "IMPLEMENTED", {})
    if "enabled" in cls.model_fields and "enabled" not in implemented:
        enabled: Any = section.enabled  # type: ignore[attr-defined]
        return [path] if enabled is True else []
    found: list[str] = []
    for name in cls.model_fields:
        if name not in section.model_fields_set:
            continue
        value = getattr(section, name)
        here = f"{path}.{_json_key(cls, name)}" if path else _json_key(cls, name)
        if isinstance(value, BaseModel):
            whole = (
                cls.model_fields[name].default is None
                and not getattr(type(value), "IMPLEMENTED", {})
                and "enabled" not in type(value).model_fields
                and name not in implemented
            )
            found.extend([here] if whole else unimplemented_keys(value, here))
        elif name not in implemented and not _is_default(cls, name, value):
            found.append(here)
    found.extend(f"{path}.{key}" if path else key for key in (section.model_extra or {}))
    return found

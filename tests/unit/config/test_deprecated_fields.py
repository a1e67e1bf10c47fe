"""DeepSpeedConfigModel's deprecated fields (`json_schema_extra={"deprecated": True, "new_param": ...}`), as client
code that subclasses it declares them: the old key moves to the new one (through `new_param_fn`) with a warning,
both together are an error catchable as DeepSpeed's AssertionError."""

from __future__ import annotations

import pytest
from pydantic import Field, ValidationError

from slipstream.config.errors import ConfigError
from slipstream.config.schema.base import DSModel


class Conf(DSModel):
    size: int = 0
    old_names: str | None = Field(
        None, json_schema_extra={"deprecated": True, "new_param": "names", "new_param_fn": lambda x: [x]}
    )
    names: list[str] | None = None
    legacy: int | None = Field(None, json_schema_extra={"deprecated": True})


def test_old_key_moves_to_the_new_one() -> None:
    with pytest.warns(DeprecationWarning, match="'old_names' is deprecated; use 'names'"):
        assert Conf(old_names="a").names == ["a"]
    with pytest.warns(DeprecationWarning):
        assert Conf.model_validate({"old_names": "b"}).names == ["b"]
    with pytest.warns(DeprecationWarning, match="'legacy' is deprecated"):
        assert Conf(legacy=3).legacy == 3  # no new_param: kept, with a warning
    assert Conf(names=["c"]).names == ["c"]


def test_both_given_is_an_error() -> None:
    with pytest.raises(ConfigError, match="names: given together with 'old_names'") as info:
        Conf(old_names="a", names=["a"])
    assert isinstance(info.value, AssertionError)
    with pytest.raises(ValidationError, match="given together"):
        Conf.model_validate({"old_names": "a", "names": ["a"]})


def test_elastic_checkpoint_at_stage3_is_logged_as_deprecated(monkeypatch: pytest.MonkeyPatch) -> None:
    from slipstream.config.schema.zero import ZeroConfig
    from slipstream.utils.logging import get_logger

    messages: list[str] = []
    monkeypatch.setattr(get_logger(), "warning", lambda message, *a, **k: messages.append(message))
    ZeroConfig(stage=2, elastic_checkpoint=True)
    ZeroConfig(stage=3)
    assert messages == []
    ZeroConfig(stage=3, elastic_checkpoint=True)
    assert len(messages) == 1 and "elastic checkpointing is deprecated for ZeRO-3" in messages[0]

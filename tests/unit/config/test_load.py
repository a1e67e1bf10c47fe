"""load_config(): dicts, JSON files, urlsafe base64, args namespaces, and the errors for bad sources."""

from __future__ import annotations

import argparse
import base64
import json
from pathlib import Path

import pytest

from slipstream.config import ConfigError, load_config, resolve

CONFIG = {"train_batch_size": 8, "zero_optimization": {"stage": 2}}


def test_dict_is_deep_copied() -> None:
    loaded = load_config(CONFIG)
    assert loaded == CONFIG
    loaded["zero_optimization"]["stage"] = 3
    assert CONFIG["zero_optimization"]["stage"] == 2


def test_path_str_and_pathlike(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(CONFIG))
    assert load_config(str(path)) == CONFIG
    assert load_config(path) == CONFIG
    assert resolve(load_config(path), world_size=1).zero.stage == 2


def test_urlsafe_base64() -> None:
    encoded = base64.urlsafe_b64encode(json.dumps(CONFIG).encode()).decode()
    assert load_config(encoded) == CONFIG
    assert load_config(encoded.rstrip("=")) == CONFIG


def test_args_deepspeed_config(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(CONFIG))
    assert load_config(argparse.Namespace(deepspeed_config=str(path))) == CONFIG
    assert load_config(argparse.Namespace(deepspeed_config=None, deepscale_config=str(path))) == CONFIG


def test_duplicate_keys_are_rejected(tmp_path: Path) -> None:
    path = tmp_path / "dup.json"
    path.write_text('{"train_batch_size": 8, "fp16": {"enabled": true, "enabled": false}}')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.problems == [
        f"{path}: enabled: duplicate key in the JSON object; keep one of the 'enabled' entries"
    ]


def test_duplicate_keys_in_base64() -> None:
    encoded = base64.urlsafe_b64encode(b'{"train_batch_size": 8, "train_batch_size": 16}').decode()
    with pytest.raises(ConfigError, match="train_batch_size: duplicate key"):
        load_config(encoded)


def test_bad_json_names_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{\n  "train_batch_size": 8,\n  "fp16": {"enabled": true]\n}')  # HJSON allows {enabled: true}
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    (problem,) = info.value.problems
    assert problem.startswith(f"{path}: invalid JSON at line 3, column 27: ")


def test_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(str(missing))
    with pytest.raises(ConfigError, match="cannot read the config file"):
        load_config(missing)


def test_bad_base64() -> None:
    with pytest.raises(ConfigError, match="neither an existing file nor urlsafe-base64 JSON"):
        load_config("not-base64-at-all!")


def test_json_that_is_not_an_object(tmp_path: Path) -> None:
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must be a JSON object, got list"):
        load_config(path)


def test_other_types() -> None:
    with pytest.raises(ConfigError, match="got int"):
        load_config(42)
    with pytest.raises(ConfigError, match="got Namespace"):
        load_config(argparse.Namespace(deepspeed_config=None))

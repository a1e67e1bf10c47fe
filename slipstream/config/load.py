"""Reading a DeepSpeed config from wherever the caller keeps it: a dict, a JSON file, or urlsafe-base64 JSON.

Mirrors `DeepSpeedConfig.__init__`: a dict is used as is (here: deep-copied), a string is a path when that
file exists and otherwise base64-encoded JSON. An argparse namespace with `deepspeed_config` (or the legacy
`deepscale_config`) is accepted too. Text is read as DeepSpeed reads it, as HJSON (JSON plus comments, trailing
commas, quoteless keys; the `hjson` package); duplicate keys are an error, as in DeepSpeed.
"""

from __future__ import annotations

import base64
import binascii
import copy
import json
import os
from typing import Any, Union

from slipstream.config.errors import ConfigError

__all__ = ["load_config"]

ConfigSource = Union[dict, str, "os.PathLike[str]"]


def _reject_duplicates(pairs: list[tuple[str, object]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError([f"{key}: duplicate key in the JSON object; keep one of the {key!r} entries"])
        out[key] = value
    return out


def _parse_json(text: str, origin: str) -> dict[str, Any]:
    """Strict JSON first (exact positions, `Infinity`), then HJSON as DeepSpeed reads configs (comments,
    trailing commas, quoteless keys); duplicate keys are an error in both."""
    try:
        data = json.loads(text, object_pairs_hook=_reject_duplicates)
    except json.JSONDecodeError:
        data = _parse_hjson(text, origin)
    except ConfigError as exc:
        raise ConfigError([f"{origin}: {p}" for p in exc.problems]) from None
    if not isinstance(data, dict):
        raise ConfigError([f"{origin}: a DeepSpeed config must be a JSON object, got {type(data).__name__}"])
    return data


def _parse_hjson(text: str, origin: str) -> Any:
    import hjson

    try:
        return hjson.loads(text, object_pairs_hook=_reject_duplicates)
    except hjson.HjsonDecodeError as exc:
        raise ConfigError(
            [
                f"{origin}: invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg} (read as HJSON, as DeepSpeed does)"
            ]
        ) from None
    except ConfigError as exc:
        raise ConfigError([f"{origin}: {p}" for p in exc.problems]) from None


def _from_path(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read the config file: {exc.strerror or exc}"]) from None
    return _parse_json(text, path)


def _looks_like_path(text: str) -> bool:
    return text.endswith((".json", ".hjson")) or os.sep in text or text.startswith(".")


def _from_base64(text: str) -> dict[str, Any]:
    try:
        decoded = base64.urlsafe_b64decode(text.encode("ascii") + b"=" * (-len(text) % 4)).decode("utf-8")
    except (binascii.Error, UnicodeError, ValueError):
        decoded = ""
    if not decoded.lstrip().startswith("{"):
        shown = text if len(text) <= 60 else text[:57] + "..."
        raise ConfigError(
            [
                f"config {shown!r} is neither an existing file nor urlsafe-base64 JSON; "
                "pass a path to a JSON file, a dict, or base64.urlsafe_b64encode(json.dumps(cfg))"
            ]
        )
    return _parse_json(decoded, "base64 config")


def load_config(source: object) -> dict[str, Any]:
    """The config as a fresh dict, from a dict, a JSON file path, urlsafe-base64 JSON, or an args namespace.

    Raises ConfigError for a missing file, invalid JSON (with line and column), duplicate keys, bad base64,
    or a source of another type.
    """
    if isinstance(source, dict):
        return copy.deepcopy(source)
    if isinstance(source, os.PathLike):
        return _from_path(os.fspath(source))
    if isinstance(source, str):
        if os.path.isfile(source):
            return _from_path(source)
        if _looks_like_path(source):
            raise ConfigError([f"{source}: config file not found (working directory: {os.getcwd()})"])
        return _from_base64(source)
    for attr in ("deepspeed_config", "deepscale_config"):
        value = getattr(source, attr, None)
        if value is not None:
            return load_config(value)
    raise ConfigError(
        [
            f"config: expected a dict, a path to a JSON file or urlsafe-base64 JSON, "
            f"got {type(source).__name__}; pass config=... or --deepspeed_config"
        ]
    )

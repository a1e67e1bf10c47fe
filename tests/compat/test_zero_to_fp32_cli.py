"""`python -m ...zero_to_fp32` (compat/zero_to_fp32.py `main`): every command-line option reaches
convert_zero_checkpoint_to_fp32_state_dict under its parameter's name, with DeepSpeed's defaults."""

from __future__ import annotations

import pytest

from slipstream.compat import zero_to_fp32


def _call(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> dict[str, object]:
    calls: list[dict[str, object]] = []
    monkeypatch.setattr(zero_to_fp32, "convert_zero_checkpoint_to_fp32_state_dict", lambda **kw: calls.append(kw))
    assert zero_to_fp32.main(argv) == 0
    (call,) = calls
    return call


def test_every_option_reaches_the_conversion(monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["ckpt", "out", "--max_shard_size", "2GB", "--safe_serialization", "-t", "global_step7",
            "--exclude_frozen_parameters"]
    assert _call(monkeypatch, argv) == {
        "checkpoint_dir": "ckpt", "output_dir": "out", "max_shard_size": "2GB", "safe_serialization": True,
        "tag": "global_step7", "exclude_frozen_parameters": True,
    }


def test_the_defaults_are_deepspeeds(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _call(monkeypatch, ["ckpt", "out"]) == {
        "checkpoint_dir": "ckpt", "output_dir": "out", "max_shard_size": "5GB", "safe_serialization": False,
        "tag": None, "exclude_frozen_parameters": False,
    }

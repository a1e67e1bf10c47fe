"""DeepSpeed's script names (slipstream/compat/scripts.py) run the subcommand they stand for."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from slipstream.cli.main import SUBCOMMANDS
from slipstream.compat import scripts


def test_every_script_names_a_subcommand_we_have() -> None:
    assert {words[0] for words in scripts.SCRIPTS.values()} <= set(SUBCOMMANDS) | {"bench", "io", "nvme"}
    for name in scripts.SCRIPTS:
        assert callable(getattr(scripts, name)) and getattr(scripts, name).__name__ == name


def test_ds_elastic_runs_slipstream_elastic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"elasticity": {"enabled": True, "max_train_batch_size": 10000,
                                                 "micro_batch_sizes": [8, 12, 16, 17], "min_gpus": 32,
                                                 "max_gpus": 1500, "version": 0.1}}))
    monkeypatch.setattr(sys, "argv", ["ds_elastic", "-c", str(config), "-w", "64", "--json"])
    assert scripts.ds_elastic() == 0
    assert json.loads(capsys.readouterr().out)["micro_batch_size"] == 17


def test_ds_ssh_takes_the_command_without_a_separator(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", ["ds_ssh", "-H", "/nonexistent", "hostname"])
    assert scripts.ds_ssh() == 2  # parsed as slipstream ssh: the missing hostfile is named
    assert "hostfile /nonexistent does not exist" in capsys.readouterr().err

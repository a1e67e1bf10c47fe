"""The export allow-list: prefixes, `.deepspeed_env` files (home, then cwd), DS_ENV_FILE, errors, the listing."""

from __future__ import annotations

from pathlib import Path

import pytest

from slipstream.launcher.environment import EnvFileError, as_mapping, collect_exports, describe_exports

ENVIRON = {
    "NCCL_DEBUG": "INFO",
    "PYTHONPATH": "/src",
    "SLIPSTREAM_LOG": "debug",
    "DS_ACCELERATOR": "cpu",
    "PATH": "/usr/bin",
    "HOME": "/root",
    "AWS_SECRET_ACCESS_KEY": "s3cr3t",
    "MY_TOKEN": "tok",
    "NCCLX": "not a prefix match",
}


def test_only_allow_listed_prefixes_travel(tmp_path: Path) -> None:
    exports = as_mapping(collect_exports(ENVIRON, cwd=tmp_path, home=tmp_path / "home"))
    assert exports == {
        "DS_ACCELERATOR": "cpu",
        "NCCL_DEBUG": "INFO",
        "PYTHONPATH": "/src",
        "SLIPSTREAM_LOG": "debug",
    }


def test_env_files_home_then_cwd_and_bare_names(tmp_path: Path) -> None:
    home, cwd = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    cwd.mkdir()
    (home / ".deepspeed_env").write_text("A=from-home\nB=from-home\n")
    (cwd / ".deepspeed_env").write_text(
        "# comment\n\nB=from cwd = with equals\nMY_TOKEN\nUNSET_NAME\nNCCL_DEBUG=WARN\n"
    )
    exports = collect_exports(ENVIRON, cwd=cwd, home=home)
    mapping = as_mapping(exports)
    assert mapping["A"] == "from-home"
    assert mapping["B"] == "from cwd = with equals"
    assert mapping["MY_TOKEN"] == "tok"
    assert mapping["NCCL_DEBUG"] == "WARN"
    assert "UNSET_NAME" not in mapping and "AWS_SECRET_ACCESS_KEY" not in mapping
    assert [e.name for e in exports] == sorted(mapping)


def test_ds_env_file_renames_the_file(tmp_path: Path) -> None:
    (tmp_path / "custom.env").write_text("X=1\n")
    (tmp_path / ".deepspeed_env").write_text("Y=1\n")
    mapping = as_mapping(collect_exports({"DS_ENV_FILE": "custom.env"}, cwd=tmp_path, home=tmp_path / "h"))
    assert mapping == {"DS_ENV_FILE": "custom.env", "X": "1"}


def test_bad_env_file_line_names_file_and_line(tmp_path: Path) -> None:
    (tmp_path / ".deepspeed_env").write_text("OK=1\n9BAD=2\n")
    with pytest.raises(EnvFileError, match=r"\.deepspeed_env, line 2: '9BAD=2' is not `KEY=VALUE` or `KEY`"):
        collect_exports({}, cwd=tmp_path, home=tmp_path / "h")


def test_listing_names_sources_but_never_values(tmp_path: Path) -> None:
    (tmp_path / ".deepspeed_env").write_text("MY_TOKEN\n")
    text = describe_exports(collect_exports(ENVIRON, cwd=tmp_path, home=tmp_path / "h"))
    assert "exporting 5 environment variable(s)" in text
    assert "NCCL_DEBUG  (environment)" in text and "MY_TOKEN  (" in text
    assert "tok" not in text.replace("MY_TOKEN", "") and "INFO" not in text
    assert "exporting no environment variables" in describe_exports([])

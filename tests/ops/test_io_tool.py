"""`slipstream io` (DeepSpeed's ds_io): the async_io op's read and write throughput in a directory, with the
`aio` settings as flags. The CLI runs whichever async_io loads here (the thread-pool fallback where the
native op cannot be built) on small files in tmp_path.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

import slipstream.ops.fallback.async_io as fallback_op
from slipstream.cli.main import main as cli_main
from slipstream.config.zero_plans import default_aio_plan
from slipstream.ops.aio.bench import IoBench
from slipstream.ops.op_builder import AsyncIOBuilder

DEFAULTS = default_aio_plan()


def _json_of(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict:
    assert cli_main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_io_measures_both_ops_at_each_size_with_the_settings_given(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    data = _json_of(capsys, ["io", str(tmp_path), "--sizes", "1M,3M", "--loops", "2", "--block-size", "256K",
                             "--queue-depth", "4", "--intra-op-parallelism", "2", "--no-overlap-events", "--json"])
    assert data["aio"] == {"block_size": 262144, "queue_depth": 4, "intra_op_parallelism": 2, "single_submit": False,
                           "overlap_events": False}  # as the handle reports them
    assert [(r["op"], r["size_bytes"], r["loops"]) for r in data["results"]] == [
        ("write", 1 << 20, 2), ("read", 1 << 20, 2), ("write", 3 << 20, 2), ("read", 3 << 20, 2)]
    for row in data["results"]:
        assert 0 < row["min_gb_s"] <= row["gb_s"] <= row["max_gb_s"]
        assert row["gb_s"] == pytest.approx(row["size_bytes"] / row["median_s"] / 1e9)
    status = AsyncIOBuilder().load_status()
    assert status is not None and data["kind"] == ("fallback" if status.how == "fallback" else f"native {status.how}")
    if data["kind"] == "fallback":
        assert data["engine"] == "python" and "thread-pool fallback ran" in data["note"]
        assert status.reason in data["note"]
    assert isinstance(data["o_direct"], bool)
    assert list(tmp_path.iterdir()) == []  # its files are removed


def test_io_table_names_the_op_the_path_and_the_settings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["io", str(tmp_path), "--sizes", "1M", "--loops", "1", "--ops", "read"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("async_io: ") and lines[1].startswith(f"path: {tmp_path.resolve()} (O_DIRECT: ")
    assert lines[2] == ("aio: block_size 1048576, queue_depth 8, intra_op_parallelism 1, single_submit false, "
                        "overlap_events true")
    assert lines[4].split()[:4] == ["read", "1", "MiB", "1"]


@pytest.mark.parametrize(("argv", "message"), [
    (["io", "{missing}"], "{missing} does not exist; give an existing directory"),
    (["io", "{file}"], "{file} is not a directory"),
    (["io", "{dir}", "--block-size", "2G"], "block_size must be in [1, 2**30]"),
])
def test_bad_paths_and_settings_are_named(argv: list[str], message: str, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a_file").write_text("x")
    names = {"missing": str(tmp_path / "nope"), "file": str(tmp_path / "a_file"), "dir": str(tmp_path)}
    assert cli_main([arg.format(**names) for arg in argv]) == 2
    assert message.format(**names) in capsys.readouterr().err


def test_flag_values_are_checked_by_the_parser(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for flags, message in ((["--queue-depth", "0"], "0: expected an integer >= 1"),
                           (["--ops", "erase"], "'erase': expected write, read or write,read")):
        with pytest.raises(SystemExit):
            cli_main(["io", str(tmp_path), *flags])
        assert message in capsys.readouterr().err


class _CorruptingHandle(fallback_op.aio_handle):
    def async_pread(self, buffer: torch.Tensor, filename: str, file_offset: int = 0) -> int:  # type: ignore[override]
        result = super().async_pread(buffer, filename, file_offset)
        self.wait()
        buffer[7] ^= 1
        return result


def test_verify_reads_back_and_names_a_size_that_came_back_different(tmp_path: Path) -> None:
    good, bad = IoBench(tmp_path, module=fallback_op), IoBench(tmp_path, module=types.SimpleNamespace(
        aio_handle=_CorruptingHandle))
    for bench in (good, bad):
        bench.measure(DEFAULTS, [1 << 16], ["write", "read"], 1)
    assert good.verify(DEFAULTS) == [] and bad.verify(DEFAULTS) == [1 << 16]
    good.close()
    bad.close()
    assert list(tmp_path.iterdir()) == []

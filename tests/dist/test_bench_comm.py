"""`slipstream bench comm` (DeepSpeed's ds_bench): what it measures and how it reports it, an op the backend
cannot run, the launcher, a world of one, bad flags, and the bus-bandwidth arithmetic.

[Note: checking the benchmark without timing it]
The figures are checked against a fake clock, not against a wall-clock timing (timings belong in bench/): in
each rank the benchmark's `time.perf_counter` reads a clock that only a wait on one of the benchmark's own calls
advances, by a fixed amount per rank (2**-10 s on rank 0, 2**-9 s on rank 1; powers of two keep the sums exact).
So every op must report exactly the slowest rank's 2**-9 s per call, in seconds, as median and mean; a call not
waited for would report 0, a wrong unit or a per-measurement time instead of a per-call one a multiple of it, and
the counted calls show the trials and warmups issued (plus the one call on which the ranks agree that the op runs).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from slipstream.cli import bench as bench_cli
from slipstream.cli.main import main as cli_main
from slipstream.comm import bench
from tests.harness import run_distributed
from tests.launcher.test_local_launch import clean_env, slipstream_run

ROOT = Path(__file__).resolve().parents[2]
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "p2p")
SIZE = 1 << 12
TRIALS, WARMUPS = 5, 2
_ISSUERS = ("all_reduce", "broadcast", "all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
            "reduce_scatter_tensor", "all_to_all_single", "isend", "irecv")


class _FakeClock:
    """`time` for the benchmark module: `perf_counter` reads `now`, which `_Waited.wait` advances."""

    def __init__(self, tick: float) -> None:
        self.now, self.tick = 0.0, tick

    def perf_counter(self) -> float:
        return self.now


class _Waited:
    """A benchmark call's work: waiting on it waits on the real one, then advances the fake clock by one tick."""

    def __init__(self, work: Any, clock: _FakeClock, counts: dict[str, int]) -> None:
        self.work, self.clock, self.counts = work, clock, counts

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        self.counts["waited"] += 1
        result = self.work.wait(*args, **kwargs)
        self.clock.now += self.clock.tick
        return result


def _counting(name: str, issue: Callable[..., Any], clock: _FakeClock, counts: dict[str, int]) -> Callable[..., Any]:
    """`issue` wrapped: a call on a float32 buffer of at least SIZE / 8 bytes is the benchmark's (the wrappers'
    own collectives, for agreement and the per-call times, use int32, float64 or tiny tensors) and is counted."""

    def call(*args: Any, **kwargs: Any) -> Any:
        work = issue(*args, **kwargs)
        tensor = args[0] if args else None
        if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32 and tensor.nbytes >= SIZE // 8:
            counts[name] = counts.get(name, 0) + 1
            counts["issued"] += 1
            return _Waited(work, clock, counts)
        return work

    return call


def _bench_json(*flags: str) -> dict | None:
    """Run the CLI in this rank; rank 0's printed JSON, None on the other ranks (they print nothing)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert bench_cli.main(["comm", "--json", *flags]) == 0
    return json.loads(out.getvalue()) if out.getvalue() else None


def _bench_with_fake_clock(rank: int, world_size: int) -> tuple[dict | None, dict[str, int]]:
    clock = _FakeClock(2.0 ** -(10 - rank))
    counts = {"issued": 0, "waited": 0}
    for name in _ISSUERS:
        if hasattr(dist, name):
            setattr(dist, name, _counting(name, getattr(dist, name), clock, counts))
    bench.time = clock  # type: ignore[assignment]  # this spawned rank's module only
    flags = ("--ops", ",".join(OPS), "--sizes", str(SIZE), "--trials", str(TRIALS), "--warmups", str(WARMUPS))
    return _bench_json(*flags), counts


def test_every_op_reports_the_slowest_rank_s_time_per_call_in_seconds() -> None:
    """See [Note: checking the benchmark without timing it]."""
    (printed, counts), (nothing, other_counts) = run_distributed(_bench_with_fake_clock, world_size=2, timeout_s=120)
    assert nothing is None and printed is not None and printed["world_size"] == 2
    calls = len(OPS) * (1 + WARMUPS + TRIALS)
    for rank, issued in enumerate((counts, other_counts)):
        assert issued["issued"] == calls and issued["waited"] == calls, (rank, issued)
    slowest = 2.0**-9
    rows = printed["results"]
    assert [row["op"] for row in rows] == list(OPS)
    for row in rows:
        assert row["unsupported"] is None and row["world_size"] == 2 and row["trials"] == TRIALS, row
        assert row["time_s"] == slowest and row["mean_time_s"] == slowest, row
        assert row["size_bytes"] == bench.elements_for(row["op"], SIZE, 4, 2) * 4 and row["dtype"] == "float32"
        assert row["algbw_gb_s"] == pytest.approx(row["size_bytes"] / slowest / 1e9, rel=1e-12)
        assert row["busbw_gb_s"] == pytest.approx(row["algbw_gb_s"] * bench.BUS_FACTORS[row["op"]](2), rel=1e-12)


def _gloo_without_reduce_scatter(rank: int, world_size: int) -> tuple[dict | None, str]:
    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("ProcessGroupGloo does not support reduce_scatter\nsecond line")

    dist.reduce_scatter_single = refuse  # type: ignore[attr-defined]  # as on a torch whose gloo lacks it
    dist.reduce_scatter_tensor = refuse
    flags = ["comm", "--ops", "reduce_scatter,broadcast", "--sizes", "4K", "--trials", "2"]
    printed = _bench_json(*flags[1:])
    table = io.StringIO()
    with contextlib.redirect_stdout(table):
        assert bench_cli.main(flags) == 0
    return printed, table.getvalue()


def test_an_op_the_backend_cannot_run_is_reported_unsupported() -> None:
    printed, table = run_distributed(_gloo_without_reduce_scatter, world_size=2, timeout_s=120)[0]
    assert printed is not None
    rows = {row["op"]: row for row in printed["results"]}
    assert rows["reduce_scatter"]["unsupported"] == "RuntimeError: ProcessGroupGloo does not support reduce_scatter"
    assert rows["reduce_scatter"]["time_s"] is None and rows["reduce_scatter"]["busbw_gb_s"] is None
    assert rows["broadcast"]["unsupported"] is None and rows["broadcast"]["time_s"] > 0
    assert "unsupported: RuntimeError: ProcessGroupGloo does not support reduce_scatter" in table
    assert table.splitlines()[-1].startswith("broadcast")


def test_under_slipstream_run_rank_0_prints_the_world_s_figures(tmp_path: Path) -> None:
    cmd = slipstream_run("--num_gpus", "2", "--module", "slipstream.cli.bench", "comm", "--json", "--sizes", "64K",
                         "--trials", "3", "--ops", "all_reduce,p2p")
    done = subprocess.run(cmd, cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    [line] = [line for line in done.stdout.splitlines() if line.startswith("[rank0]:{")]
    printed = json.loads(line.removeprefix("[rank0]:"))
    assert printed["world_size"] == 2 and printed["backend"] == "gloo"
    assert [(r["op"], r["size_bytes"], r["unsupported"]) for r in printed["results"]] == [
        ("all_reduce", 65536, None), ("p2p", 65536, None)]
    assert not [line for line in done.stdout.splitlines() if line.startswith("[rank1]:")]
    assert "world of one" not in done.stderr


def test_without_a_launcher_it_is_a_world_of_one_and_says_how_to_launch(capsys: pytest.CaptureFixture[str]) -> None:
    if dist.is_initialized() or any(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR")):
        pytest.skip("a process group or a launcher environment is already present in this test process")
    try:
        assert cli_main(["bench", "comm", "--json", "--sizes", "4K", "--trials", "2", "--ops", "all_reduce,p2p"]) == 0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    captured = capsys.readouterr()
    printed = json.loads(captured.out)
    assert printed["world_size"] == 1
    rows = {row["op"]: row for row in printed["results"]}
    assert rows["all_reduce"]["busbw_gb_s"] == 0.0  # 2(n-1)/n of nothing crossing a link
    assert rows["p2p"]["unsupported"] == "point-to-point needs 2 or more ranks; this world has 1"
    assert "world of one" in captured.err
    assert "slipstream run --num_gpus N --module slipstream.cli.bench comm" in captured.err


def test_an_incomplete_launcher_environment_is_an_error_naming_the_fix(monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this test process")
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    assert cli_main(["bench", "comm", "--sizes", "4K"]) == 2
    err = capsys.readouterr().err
    assert "WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set" in err
    assert "slipstream run --num_gpus N --module slipstream.cli.bench comm" in err
    assert not dist.is_initialized()


@pytest.mark.parametrize(("flags", "message"), [
    (["--ops", "all_reduce,allreduce"], "unknown op(s) allreduce; choose from all_reduce,all_gather"),
    (["--sizes", "0"], "'0': a size must be at least one byte"),
    (["--sizes", "1Q"], "'1Q' is not a size"),
    (["--trials", "0"], "0: expected an integer >= 1"),
])
def test_bad_flags_name_the_value_and_the_choices(flags: list[str], message: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["bench", "comm", *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_bus_factors_sizes_and_scan() -> None:
    assert {op: bench.BUS_FACTORS[op](4) for op in bench.OPS} == {
        "all_reduce": 1.5, "all_gather": 0.75, "reduce_scatter": 0.75, "all_to_all": 0.75, "broadcast": 1.0,
        "p2p": 1.0}
    assert bench.BUS_FACTORS["all_reduce"](8) == 1.75 and bench.BUS_FACTORS["all_gather"](1) == 0.0
    assert bench.elements_for("all_reduce", 1000, 4, 3) == 250
    assert bench.elements_for("all_gather", 1000, 4, 3) == 249  # whole chunks per rank
    assert bench.elements_for("all_to_all", 4, 4, 8) == 8  # at least one element per rank
    assert tuple(bench_cli.OPS) == bench.OPS  # the CLI's copy (no torch import for --help) matches
    parser = bench_cli.build_parser()
    assert bench_cli.sizes_of(parser.parse_args(["comm", "--scan", "--maxsize", "8K"])) == [1024, 2048, 4096, 8192]
    assert bench_cli.sizes_of(parser.parse_args(["comm", "--sizes", "1K,1M"])) == [1024, 1 << 20]

"""Rank faults: a hung, killed or diverging rank ends the job within the timeout + 15 s, named, no orphans.

`slipstream run` starts fault_job.py on 2 ranks at ZeRO-2 and ZeRO-3 with "collective_timeout": TIMEOUT_S; at step
3 rank 1 stops itself (SIGSTOP), kills itself (SIGKILL) or calls save_checkpoint alone, while rank 0 trains on.
The last two tests (not slow) check the job's account of a failure: a rank ended by a SIGTERM from outside the job
is the one the launcher names, and a rank stopped inside a ZeRO-3 gather that every rank reached is named by the
error, which each rank log carries once, with one `[rank<N>]:` prefix on the console.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.launcher.test_local_launch import assert_no_orphans, clean_env, slipstream_run

JOB = Path(__file__).with_name("fault_job.py")
TIMEOUT_S = 8  # long enough for a loaded 2-core machine never to time out a healthy step
BOUND_S = TIMEOUT_S + 15  # from the fault until every process of the job is gone (the bound)


def _shm_names() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _shm_of(pids: list[int], before: set[str]) -> list[str]:
    """Shared-memory files made during the job (not in `before`) that name one of its processes."""
    # a pid as a whole number in the name (torch_<pid>_...): random names (sem.mp-kb42989x) may hold its digits
    owned = re.compile("|".join(rf"(?<!\d){pid}(?!\d)" for pid in pids))
    return [name for name in _shm_names() - before if owned.search(name)]


def run_fault(tmp_path: Path, stage: int, fault: str, timeout_s: float = TIMEOUT_S) -> dict[str, object]:
    tag, logs, shm_before = f"tag-{uuid.uuid4().hex}", tmp_path / "logs", _shm_names()
    cmd = slipstream_run("--num_gpus", "2", "--enable_each_rank_log", str(logs), str(JOB), "--stage", str(stage),
                         "--fault", fault, "--timeout", str(timeout_s), "--out", str(tmp_path / "ckpt"), tag)
    launcher = subprocess.Popen(cmd, cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    try:
        stdout, stderr = launcher.communicate(timeout=120 + BOUND_S)  # bounds a runaway only; asserted below
    finally:
        launcher.kill()
    ended = time.time()
    output = stdout + stderr
    faulted = re.search(r"FAULT (\d+\.\d+)", stdout)
    assert faulted, output[-4000:]
    pids = [int(pid) for pid in re.findall(r"rank \d pid (\d+)", stdout)]
    assert len(pids) == 2, output[-4000:]
    assert_no_orphans(tag)
    assert not _shm_of([launcher.pid, *pids], shm_before), _shm_of([launcher.pid, *pids], shm_before)
    rank_logs = {rank: next(logs.glob(f"*_rank{rank}.log")).read_text() for rank in (0, 1)}
    return {"code": launcher.returncode, "after_s": ended - float(faulted.group(1)), "stderr": stderr,
            "stdout": stdout, "output": output, "logs": rank_logs}


STAGES = [2, 3]


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_a_stopped_rank_ends_the_job(tmp_path: Path, stage: int) -> None:
    result = run_fault(tmp_path, stage, "sigstop")
    assert result["code"] == 1, result["output"][-4000:]  # type: ignore[index]
    assert result["after_s"] < BOUND_S, result["after_s"]  # type: ignore[operator]
    stderr, log0 = str(result["stderr"]), result["logs"][0]  # type: ignore[index]
    assert "rank 0 (local rank 0) failed with exit code 1" in stderr, stderr[-4000:]
    # not SIGKILL 30 s on
    assert "rank 1 (local rank 1) was stopped by the launcher and ended with signal SIGTERM" in stderr, stderr[-4000:]
    message = next(line for line in log0.splitlines() if "CollectiveTimeout: collective" in line)
    assert "did not complete within 8 s" in message and "missing ranks [1]" in message, message
    assert re.search(r"rank 1 \(pid \d+ on this host\) is stopped \(SIGSTOP", message), message
    assert re.search(r"after (\d+\.\d) s", message), message


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_a_killed_rank_ends_the_job(tmp_path: Path, stage: int) -> None:
    result = run_fault(tmp_path, stage, "sigkill")
    stderr, log0 = str(result["stderr"]), result["logs"][0]  # type: ignore[index]
    assert result["code"] in (1, 128 + 9), result["output"][-4000:]  # type: ignore[index]
    assert result["after_s"] < BOUND_S, result["after_s"]  # type: ignore[operator]
    assert re.search(r"rank 1 \(local rank 1\) (failed|also ended) with signal SIGKILL", stderr), stderr[-4000:]
    if "Error" in log0:  # rank 0 saw the closed connection before the agent stopped it: said so, not a timeout
        assert "PeerLost: collective" in log0 and "CollectiveTimeout" not in log0, log0[-3000:]
        assert "the connection to a peer closed" in log0 and "missing ranks [1]" in log0, log0[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_a_save_on_one_rank_ends_the_job_naming_both_operations(tmp_path: Path, stage: int) -> None:
    result = run_fault(tmp_path, stage, "save")
    assert result["code"] == 1, result["output"][-4000:]  # type: ignore[index]
    assert result["after_s"] < BOUND_S, result["after_s"]  # type: ignore[operator]
    log0, log1 = result["logs"][0], result["logs"][1]  # type: ignore[index]
    saving = next(line for line in log1.splitlines() if "CheckpointError: save_checkpoint" in line)
    assert "ranks [0] never arrived (arrived: [1]; rank 0 reached #" in saving, saving
    assert "reduce_scatter" in saving and "instead: the ranks issued different collectives" in saving, saving
    training = next(line for line in log0.splitlines() if "CollectiveTimeout: collective" in line)
    assert "missing ranks [1]" in training and "all_gather of 2 elements from slipstream/checkpoint/save.py" \
        in training, training
    assert not (tmp_path / "ckpt" / "lonely").exists()


def failed_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("slipstream: host") and " failed with " in line]


def test_an_outside_sigterm_is_blamed_on_the_rank_it_ended(tmp_path: Path) -> None:
    result = run_fault(tmp_path, 3, "sigterm")
    stderr, log0 = str(result["stderr"]), str(result["logs"][0])  # type: ignore[index]
    assert result["code"] == 128 + 15, result["output"][-4000:]  # type: ignore[index]
    assert failed_lines(stderr) == [line for line in stderr.splitlines() if "rank 1 (local rank 1) failed with "
                                    "signal SIGTERM" in line], stderr[-4000:]
    # rank 0 got the agent's SIGTERM, or exited on its own on the lost peer before the agent saw rank 1 end
    assert re.search(r"rank 0 \(local rank 0\) (was stopped by the launcher and ended with signal SIGTERM|also "
                     r"ended with exit code 1)", stderr), stderr[-4000:]
    assert "always_call" not in log0, log0[-3000:]
    assert len(re.findall(r"collective \w+ #\d+", log0)) <= 1, log0[-3000:]  # the lost peer, reported once


def test_a_rank_stopped_inside_a_gather_every_rank_reached_is_named_once(tmp_path: Path) -> None:
    result = run_fault(tmp_path, 3, "stop_in_gather", timeout_s=5)
    stderr, stdout, log0 = str(result["stderr"]), str(result["stdout"]), str(result["logs"][0])  # type: ignore[index]
    assert result["code"] == 1, result["output"][-4000:]  # type: ignore[index]
    assert failed_lines(stderr) == [line for line in stderr.splitlines() if "rank 0 (local rank 0) failed with "
                                    "exit code 1" in line], stderr[-4000:]
    assert "rank 1 (local rank 1) was stopped by the launcher and ended with signal SIGTERM" in stderr, stderr[-4000:]
    message = next(line for line in log0.splitlines() if "CollectiveTimeout: collective all_gather" in line)
    assert "missing ranks" not in message and "every rank arrived (ranks [0, 1]), then rank 1 (pid" in message, message
    assert re.search(r"rank 1 \(pid \d+ on this host\) is stopped \(SIGSTOP or a debugger\), its last collective "
                     r"#\d+ all_gather of \d+ elements from slipstream/zero/stage3/unit.py", message), message
    assert "always_call" not in log0 and len(re.findall(r"collective \w+ #\d+", log0)) == 1, log0[-3000:]
    assert "[rank0]:[rank0]" not in stdout and "[rank0]:Traceback (most recent call last):" in stdout, stdout[-3000:]

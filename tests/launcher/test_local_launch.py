"""`slipstream run` end to end on this machine: training, the per-rank environment, failures, signals, restarts.

Each test runs the real command in a subprocess (`python -m slipstream.cli.main run ...`) and, where a job
fails or is stopped, scans /proc for any process still carrying the test's unique tag (no orphans).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from slipstream.launcher.local import describe_failures, exit_code_of

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "gpt"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def slipstream_run(*args: str) -> list[str]:
    return [sys.executable, "-m", "slipstream.cli.main", "run", "--master_port", str(free_port()), *args]


def clean_env() -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return env


def processes_with(tag: str) -> list[str]:
    """Command lines of live processes whose argv contains `tag` (psutil-free: /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                argv = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = (entry / "stat").read_text().split(") ", 1)[1][:1]
            except OSError:
                continue
            if tag in argv and state != "Z":
                found.append(f"{entry.name}: {argv}")
    return found


def assert_no_orphans(tag: str, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while processes_with(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not processes_with(tag), f"processes of the job are still alive: {processes_with(tag)}"


ENV_SCRIPT = """
import os, sys
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "OMP_NUM_THREADS"]
print("ENV", " ".join(f"{k}={os.environ.get(k)}" for k in keys), "cores", sorted(os.sched_getaffinity(0)),
      "args", " ".join(sys.argv[1:]))
print("stderr of", os.environ["RANK"], file=sys.stderr)
"""

FAIL_SCRIPT = """
import os, sys, time
os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
print(f"rank {rank} ready", flush=True)
if rank == 1:
    for i in range(30):
        print(f"rank 1 line {i}")
    raise RuntimeError("rank 1 fails on purpose")
dist.barrier()  # rank 0 waits here for a rank that never comes
time.sleep(120)
"""

SLEEP_SCRIPT = """
import os, time
print(f"rank {os.environ['RANK']} ready", flush=True)
time.sleep(120)
"""

RESTART_SCRIPT = """
import os, sys
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
print(f"rank {os.environ['RANK']} attempt {attempt}", flush=True)
if attempt == "0" and os.environ["RANK"] == "1":
    sys.exit(3)
"""


@pytest.mark.slow
def test_gpt_example_trains_on_two_ranks(tmp_path: Path) -> None:
    cmd = slipstream_run("--num_gpus", "2", str(EXAMPLE / "train.py"), "--deepspeed_config",
                         str(EXAMPLE / "ds_config_zero2.json"), "--steps", "6", "--print_every", "2",
                         "--sample_chars", "10", "--out_dir", str(tmp_path))
    done = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=120, check=False)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert re.search(r"\[rank0\]:train.py: step +6/6 +loss \d+\.\d+", done.stdout), out[-4000:]
    assert "world size 2" in done.stdout and "OK: the loss fell" in done.stdout


def test_each_rank_gets_its_environment_log_and_cores(tmp_path: Path) -> None:
    script, logs = tmp_path / "env_script.py", tmp_path / "logs"
    script.write_text(ENV_SCRIPT)
    cmd = slipstream_run("--num_gpus", "2", "--enable_each_rank_log", str(logs), "--bind_core_list", "0-1",
                         str(script), "--flag", "x y")
    done = subprocess.run(cmd, cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in (0, 1):
        line = next(line for line in done.stdout.splitlines() if line.startswith(f"[rank{rank}]:ENV"))
        assert f"RANK={rank} LOCAL_RANK={rank} WORLD_SIZE=2 LOCAL_SIZE=2 CROSS_RANK=0 CROSS_SIZE=1 " \
               f"MASTER_ADDR=127.0.0.1 MASTER_PORT=" in line
        assert f"OMP_NUM_THREADS=1 cores [{rank}] args --local_rank={rank} --flag x y" in line
        [log] = logs.glob(f"*_rank{rank}.log")
        assert log.read_text().splitlines()[-1] == f"stderr of {rank}"  # stderr merged into the rank's log


def test_no_local_rank_module_and_no_python(tmp_path: Path) -> None:
    (tmp_path / "envmod.py").write_text(ENV_SCRIPT)
    cmd = slipstream_run("--num_gpus", "1", "--no_local_rank", "--module", "envmod", "--z")
    env = {**clean_env(), "PYTHONPATH": f"{ROOT}:{tmp_path}"}
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0 and "args --z" in done.stdout, done.stdout + done.stderr
    done = subprocess.run(slipstream_run("--num_gpus", "1", "--no_python", "echo", "hi"), cwd=tmp_path,
                          env=clean_env(), capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0 and "[rank0]:--local_rank=0 hi" in done.stdout, done.stdout + done.stderr


def test_failing_rank_stops_the_job_and_reports_its_tail(tmp_path: Path) -> None:
    tag = f"tag-{uuid.uuid4().hex}"
    script = tmp_path / "fail_script.py"
    script.write_text(FAIL_SCRIPT)
    started = time.monotonic()
    done = subprocess.run(slipstream_run("--num_gpus", "2", str(script), tag), cwd=tmp_path, env=clean_env(),
                          capture_output=True, text=True, timeout=60, check=False)
    elapsed = time.monotonic() - started
    assert done.returncode == 1, done.stdout + done.stderr
    assert elapsed < 40, f"the job took {elapsed:.0f} s to stop"
    report = done.stderr[done.stderr.index("slipstream: host localhost rank 1"):]
    assert "rank 1 (local rank 1) failed with exit code 1; log: " in report
    tail = report.split("----- last 20 lines of rank 1 on localhost -----\n", 1)[1].split("----- end")[0]
    lines = tail.splitlines()
    assert len(lines) == 20 and lines[-1].endswith("RuntimeError: rank 1 fails on purpose")  # torch may prefix
    assert any(line.endswith("Traceback (most recent call last):") for line in lines) and "rank 1 line 29" in lines
    assert "rank 0 (local rank 0) was stopped by the launcher and ended" in report
    assert_no_orphans(tag)


def ended(local_rank: int, pid: int, exitcode: int) -> SimpleNamespace:
    """A stand-in for torch's ProcessFailure (same second: the agent stamps its failures when it collects them)."""
    name = signal.Signals(-exitcode).name if exitcode < 0 else ""
    return SimpleNamespace(local_rank=local_rank, pid=pid, exitcode=exitcode, timestamp=1, signal_name=lambda: name)


def test_the_rank_named_first_is_never_one_the_agent_stopped() -> None:
    term, kill, abort = -signal.SIGTERM, -signal.SIGKILL, -signal.SIGABRT
    cases = [  # failures by global rank, pids the agent signalled, the rank to name
        ({0: ended(0, 100, term), 1: ended(1, 101, term)}, {100}, 1),  # SIGTERM from outside hit rank 1
        ({0: ended(0, 100, 1), 1: ended(1, 101, term)}, set(), 1),  # rank 0 exited on the lost peer first
        ({0: ended(0, 100, term), 1: ended(1, 101, 1)}, {100}, 1),  # rank 1 raised
        ({0: ended(0, 100, abort), 1: ended(1, 101, kill)}, set(), 1),  # OOM kill before a peer's abort
        ({0: ended(0, 100, kill), 1: ended(1, 101, 1)}, {100}, 1),  # the agent's SIGKILL after its grace period
    ]
    for failures, stopped, blamed in cases:
        report = describe_failures(failures, host="h", paths={}, stopped_by_agent=frozenset(stopped))
        first = report.splitlines()[0]
        assert first.startswith(f"slipstream: host h rank {blamed} ") and " failed with " in first, (failures, report)
        for rank, failure in failures.items():
            if failure.pid in stopped:
                assert f"rank {rank} (local rank {rank}) was stopped by the launcher and ended" in report, report
        code = exit_code_of(failures, stopped_by_agent=frozenset(stopped))
        assert code == (failures[blamed].exitcode if failures[blamed].exitcode > 0 else 128 - failures[blamed].exitcode)


def test_sigterm_to_the_launcher_stops_every_rank(tmp_path: Path) -> None:
    tag = f"tag-{uuid.uuid4().hex}"
    script = tmp_path / "sleep_script.py"
    script.write_text(SLEEP_SCRIPT)
    launcher = subprocess.Popen(slipstream_run("--num_gpus", "2", str(script), tag), cwd=tmp_path, env=clean_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert launcher.stdout is not None
    seen: list[str] = []
    deadline = time.monotonic() + 30
    while sum("ready" in line for line in seen) < 2 and time.monotonic() < deadline:
        seen.append(launcher.stdout.readline())
    assert sum("ready" in line for line in seen) == 2, "".join(seen)
    assert len(processes_with(tag)) >= 3  # the launcher and both ranks
    launcher.send_signal(signal.SIGTERM)
    rest, _ = launcher.communicate(timeout=30)
    assert launcher.returncode == 128 + signal.SIGTERM, "".join(seen) + rest
    assert "got SIGTERM; stopped every rank of this node" in rest
    assert_no_orphans(tag)


@pytest.mark.slow
def test_elastic_training_restarts_a_failed_rank(tmp_path: Path) -> None:
    script = tmp_path / "restart_script.py"
    script.write_text(RESTART_SCRIPT)
    cmd = slipstream_run("--num_gpus", "2", "--elastic_training", "--max_restarts", "1", str(script))
    done = subprocess.run(cmd, cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=90, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rank 1 attempt 0" in done.stdout and "rank 1 attempt 1" in done.stdout

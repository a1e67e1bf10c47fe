"""`slipstream run --launcher ssh` for real: a 2-node x 1-rank ZeRO-2 job through two loopback sshd servers.

Owns the end-to-end multi-node checks of the launcher. `tests.harness.sshd` starts key-only sshd servers on
127.0.0.2 and 127.0.0.3 (the two "nodes" of a hostfile); the launcher logs in to each with the ssh options
given as `--launcher_args` and starts `tests/launcher/multinode_job.py` there. Checked: the job exits 0,
both ranks report world size 2 with the launcher's environment, and their parameters are bit-identical
after training; when rank 1 raises, the launcher exits non-zero, names host 127.0.0.3 and rank 1 and
shows the traceback, and no process of the job is left on any "node". Skipped, with the reason, where
sshd cannot run (see `tests.harness.sshd.missing_requirement`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.harness.sshd import SshServers, sshd_servers

ROOT = Path(__file__).resolve().parents[2]
JOB = "tests/launcher/multinode_job.py"  # relative: the launcher must cd to this directory on every node
MASTER_ADDR = "127.0.0.2"
LAUNCH_TIMEOUT_S = 60.0
TAG_VARIABLE = "MULTINODE_TEST_TAG"  # marks the launcher's local processes; not exported to the nodes
LEFTOVER_GRACE_S = 5.0  # how long the job's processes get to disappear after the launcher exits
RESULT = re.compile(
    r"RESULT rank=(?P<rank>\d+) world_size=(?P<world_size>\d+) local_rank=(?P<local_rank>\S+) "
    r"local_rank_arg=(?P<local_rank_arg>-?\d+) master=(?P<master>\S+) final_loss=(?P<loss>\S+) "
    r"checksum=(?P<checksum>[0-9a-f]{16})"
)
RANK_1 = re.compile(r"\brank\W{0,3}1\b", re.IGNORECASE)
ZERO2_CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 700},
}


@dataclass(frozen=True, kw_only=True, slots=True)
class Launch:
    """One finished `slipstream run`: exit status, stdout and stderr together, and the unique job tag."""

    returncode: int
    output: str
    tag: str
    seconds: float

    def describe(self) -> str:
        return f"`slipstream run` exited {self.returncode} after {self.seconds:.1f} s; output:\n{self.output[-6000:]}"


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[SshServers]:
    """Two sshd "nodes" (127.0.0.2, 127.0.0.3) on one port, stopped with everything under them afterwards."""
    with sshd_servers(tmp_path) as running:
        yield running


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _launcher_env() -> dict[str, str]:
    """The test's environment without a surrounding job's rank variables; PYTHONPATH reaches every node."""
    launcher_vars = {
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_SIZE",
        "CROSS_RANK",
        "CROSS_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    }
    env = {k: v for k, v in os.environ.items() if k not in launcher_vars}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def _launch(servers: SshServers, tmp_path: Path, *job_args: str) -> Launch:
    """Run the 2-node job through the launcher; on timeout kill the launcher's process group and fail."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{host} slots=1\n" for host in servers.hosts))
    config = tmp_path / "ds_config_zero2.json"
    config.write_text(json.dumps(ZERO2_CONFIG))
    tag = f"mn-{uuid.uuid4().hex[:12]}"
    cmd = [
        sys.executable, "-m", "slipstream.cli.main", "run",
        "--hostfile", str(hostfile), "--launcher", "ssh",
        "--master_addr", MASTER_ADDR, "--master_port", str(_free_port(MASTER_ADDR)),
        "--launcher_args", servers.ssh_options,
        "--enable_each_rank_log", str(tmp_path / "rank_logs"),
        JOB, "--deepspeed_config", str(config), "--tag", tag, *job_args,
    ]  # fmt: skip
    started = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env={**_launcher_env(), TAG_VARIABLE: tag},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(
            f"`slipstream run` did not finish within {LAUNCH_TIMEOUT_S} s; output:\n{output[-6000:]}\n"
            f"sshd logs:\n{servers.logs()}"
        )
    return Launch(returncode=proc.returncode, output=output, tag=tag, seconds=time.monotonic() - started)


def _processes_with(tag: str) -> dict[int, str]:
    """Processes (other than this one) with `tag` on their command line (the ranks) or in their environment
    as TAG_VARIABLE (the launcher and what it starts here: ssh clients): pid -> command line."""
    found: dict[int, str] = {}
    in_environ = f"{TAG_VARIABLE}={tag}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if tag in cmdline or in_environ in environ:
            found[int(entry.name)] = cmdline
    return found


def _leftovers(servers: SshServers, tag: str) -> dict[int, str]:
    """The job's processes still alive: tagged on the command line, or started through the sshd servers."""
    left = _processes_with(tag)
    for pid in servers.processes():
        with contextlib.suppress(OSError):
            left.setdefault(
                pid, (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            )
    return left


def assert_no_leftovers(servers: SshServers, launch: Launch) -> None:
    """No process of the job (ssh client, sshd session, remote shell, node agent, rank) outlives the
    launcher by more than LEFTOVER_GRACE_S."""
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    left = _leftovers(servers, launch.tag)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = _leftovers(servers, launch.tag)
    listing = "\n".join(f"  {pid}: {cmd.strip()[:300]}" for pid, cmd in sorted(left.items()))
    assert not left, (
        f"{len(left)} process(es) of the job still run {LEFTOVER_GRACE_S} s after the launcher exited:\n"
        f"{listing}\n{launch.describe()}"
    )


def test_the_two_sshd_nodes_accept_the_test_key(servers: SshServers) -> None:
    """The fixture alone, so that a launcher failure below is not mistaken for an ssh setup problem."""
    for host in servers.hosts:
        probe = "import os, sys; print(os.environ['SSH_CONNECTION'].split()[2], sys.version_info[:2])"
        done = subprocess.run(
            servers.ssh_argv(host, shlex.join([sys.executable, "-c", probe])),
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        assert done.returncode == 0, f"ssh {host} failed ({done.returncode}): {done.stderr}\n{servers.logs()}"
        assert done.stdout.split()[0] == host, f"ssh {host} reached {done.stdout!r}"


def test_two_nodes_train_zero2_in_lockstep(servers: SshServers, tmp_path: Path) -> None:
    launch = _launch(servers, tmp_path, "--steps", "4")
    assert launch.returncode == 0, f"{launch.describe()}\nsshd logs:\n{servers.logs()}"
    results = {int(m["rank"]): m for m in RESULT.finditer(launch.output)}
    assert sorted(results) == [0, 1], f"expected a RESULT line from ranks 0 and 1; {launch.describe()}"
    for rank, result in results.items():
        assert result["world_size"] == "2", f"rank {rank}: {result.group(0)}"
        # one slot per node: each node's only rank is its local rank 0, in the env and as --local_rank
        assert (result["local_rank"], result["local_rank_arg"]) == ("0", "0"), (
            f"rank {rank}: {result.group(0)}"
        )
        assert result["master"].startswith(f"{MASTER_ADDR}:"), f"rank {rank}: {result.group(0)}"
        assert float(result["loss"]) == float(result["loss"]), f"rank {rank} loss is NaN: {result.group(0)}"
    assert results[0]["checksum"] == results[1]["checksum"], (
        "the two nodes' parameters differ after ZeRO-2 training (gradients not all-reduced across nodes?):\n"
        f"{results[0].group(0)}\n{results[1].group(0)}"
    )
    assert_no_leftovers(servers, launch)


@pytest.mark.parametrize("fail_at", ["step", "init"])
def test_failing_rank_on_second_node_stops_the_job(servers: SshServers, tmp_path: Path, fail_at: str) -> None:
    # "step": rank 0 then fails too, in its next collective; "init": rank 0 would wait in the process
    # group's rendezvous for minutes, so only the launcher stopping it ends the job in time
    launch = _launch(servers, tmp_path, "--steps", "50", "--fail_rank", "1", "--fail_at", fail_at)
    assert launch.returncode != 0, f"rank 1 raised but the launcher exited 0; {launch.describe()}"
    named = [line for line in launch.output.splitlines() if "127.0.0.3" in line and RANK_1.search(line)]
    assert named, f"no line names the failing host 127.0.0.3 and rank 1 together; {launch.describe()}"
    assert "fails on purpose" in launch.output, f"rank 1's traceback tail is not shown; {launch.describe()}"
    logs = [p for p in (tmp_path / "rank_logs").rglob("*rank1*.log") if "fails on purpose" in p.read_text()]
    assert logs, f"no rank-1 log with the traceback under --enable_each_rank_log {tmp_path / 'rank_logs'}"
    assert not RESULT.search(launch.output), f"a rank finished although rank 1 failed; {launch.describe()}"
    assert_no_leftovers(servers, launch)

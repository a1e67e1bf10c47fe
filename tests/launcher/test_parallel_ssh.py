"""`slipstream ssh` for real, through two loopback sshd "nodes": output prefixed by host, status per host and
overall, include/exclude filters. Skipped, with the reason, where sshd cannot run."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from slipstream.launcher.parallel_ssh import HostResult, overall_status
from tests.harness.sshd import SshServers, sshd_servers

ROOT = Path(__file__).resolve().parents[2]
# exits 3 on the node whose address is 127.0.0.3, 0 elsewhere (sshd sets SSH_CONNECTION = client, server)
FAIL_ON_SECOND = "import os, sys; print('on', os.environ['SSH_CONNECTION'].split()[2]); " \
                 "sys.exit(3 if os.environ['SSH_CONNECTION'].split()[2] == '127.0.0.3' else 0)"


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[SshServers]:
    with sshd_servers(tmp_path) as running:
        yield running


def _ssh(servers: SshServers, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{host} slots=1\n" for host in servers.hosts))
    return subprocess.run([sys.executable, "-m", "slipstream.cli.main", "ssh", "-H", str(hostfile),
                           "--launcher_args", servers.ssh_options, *extra], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)


def test_one_command_on_every_host(servers: SshServers, tmp_path: Path) -> None:
    ok = _ssh(servers, tmp_path, "--", sys.executable, "-c", "print('hello from', 'slipstream')")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert sorted(ok.stdout.splitlines()) == [f"{host}: hello from slipstream" for host in servers.hosts]
    assert all(f"{host} exited 0" in ok.stderr for host in servers.hosts)
    failing = _ssh(servers, tmp_path, "--", sys.executable, "-c", FAIL_ON_SECOND)
    assert failing.returncode == 3
    assert "127.0.0.2: on 127.0.0.2" in failing.stdout and "127.0.0.3: on 127.0.0.3" in failing.stdout
    assert "127.0.0.2 exited 0" in failing.stderr and "127.0.0.3 exited 3" in failing.stderr
    only_first = _ssh(servers, tmp_path, "-e", "127.0.0.3", "--", sys.executable, "-c", FAIL_ON_SECOND)
    assert only_first.returncode == 0 and "127.0.0.3" not in only_first.stdout


def test_overall_status_and_a_missing_command() -> None:
    assert overall_status([HostResult(host="a", returncode=0), HostResult(host="b", returncode=0)]) == 0
    assert overall_status([HostResult(host="a", returncode=0), HostResult(host="b", returncode=5)]) == 5
    assert overall_status([HostResult(host="a", returncode=-9)]) == 1  # killed by a signal
    result = subprocess.run([sys.executable, "-m", "slipstream.cli.main", "ssh", "-H", "/nonexistent", "--", "x"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "hostfile /nonexistent does not exist" in result.stderr

"""Throwaway OpenSSH servers on loopback addresses, so multi-node launches can be tested on one machine.

Owns `sshd_servers`: it starts one `sshd -D -e` per address (127.0.0.2 and 127.0.0.3 by default, all on
the same port, as nodes of a cluster would be) with key-only authentication, host keys and a client key
made with ssh-keygen in the test's temp dir, and stops them, and every process started through them, at
exit. What it cannot provide (no sshd, ssh or ssh-keygen binary, no /run/sshd for a root sshd, an unusable
loopback address) makes it call `pytest.skip` with the missing piece and how `.ci/run` provides it.

On Linux all of 127.0.0.0/8 is routed to the loopback device, so 127.0.0.2 and 127.0.0.3 need no setup.
A root sshd needs its privilege separation directory (/run/sshd), created here when missing; a non-root
sshd works too, logging in only the user it runs as (the one running the tests). Processes started
through the servers carry a marker variable (sshd `SetEnv`), so teardown finds them even when orphaned.
"""

from __future__ import annotations

import errno
import getpass
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import pytest

DEFAULT_HOSTS = ("127.0.0.2", "127.0.0.3")
_PRIVSEP_DIR = Path("/run/sshd")
_MARKER_VAR = "SLIPSTREAM_TEST_SSHD"
_START_TIMEOUT_S = 10.0


@dataclass(frozen=True, kw_only=True, slots=True)
class SshServers:
    """Running sshd servers: where they listen and how a client logs in to them."""

    hosts: tuple[str, ...]
    """Loopback addresses, one sshd each; they play the nodes of a hostfile."""
    port: int
    """The port every server listens on."""
    key: Path
    """The client's private key (its public half is the servers' only authorized key)."""
    user: str
    """The user the client logs in as (the one running the tests)."""
    log_dir: Path
    """Where each server's stderr goes (`sshd-<host>.log`): the first place to look when a login fails."""
    marker: str
    """Set by the servers (sshd `SetEnv`) in the environment of every process started through them."""
    listener_pids: tuple[int, ...]
    """The sshd servers themselves."""

    @property
    def ssh_options(self) -> str:
        """The ssh client options for `--launcher_args`: port, key, no host-key prompts, no passwords."""
        return (
            f"-p {self.port} -i {self.key} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null "
            "-o BatchMode=yes -o LogLevel=ERROR"
        )

    def ssh_argv(self, host: str, *command: str) -> list[str]:
        """The argv of `ssh <options> host command...`, for checks outside the launcher."""
        return ["ssh", *self.ssh_options.split(), host, *command]

    def processes(self) -> list[int]:
        """Live processes started through the servers (sessions, remote commands, their orphans)."""
        return processes_started_through(self.marker, listener_pids=self.listener_pids)

    def logs(self) -> str:
        """Every server's log, for failure messages."""
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')}" for p in sorted(self.log_dir.glob("*.log"))
        )


def missing_requirement() -> str | None:
    """Why sshd servers cannot run here, or None when they can (checked before anything is started)."""
    for tool in ("sshd", "ssh", "ssh-keygen"):
        if _find(tool) is None:
            return (
                f"no `{tool}` binary (OpenSSH) on PATH or in /usr/sbin: `.ci/run` installs it before `make test` "
                "(apt-get install openssh-server openssh-client); elsewhere install OpenSSH's server and client"
            )
    if os.geteuid() == 0:  # as root sshd drops privileges into this directory; as another user it does not
        try:
            _PRIVSEP_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
        except OSError as exc:
            return (
                f"cannot create sshd's privilege separation directory {_PRIVSEP_DIR}: {exc}; `.ci/run` runs "
                "as root, which can; elsewhere `mkdir /run/sshd` once as root"
            )
    return None


def _find(tool: str) -> str | None:
    return shutil.which(tool) or shutil.which(tool, path="/usr/sbin:/usr/local/sbin:/sbin")


def _pick_port(hosts: Sequence[str], *, attempts: int = 20) -> int:
    """A TCP port free on every address of `hosts` (skips the test when an address cannot be bound)."""
    for _ in range(attempts):
        with socket.socket() as first:
            try:
                first.bind((hosts[0], 0))
            except OSError as exc:
                _skip_unusable(hosts[0], exc)
            port = first.getsockname()[1]
            if all(_can_bind(host, port) for host in hosts[1:]):
                return port
    raise RuntimeError(f"found no TCP port free on all of {list(hosts)} in {attempts} attempts")


def _can_bind(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRNOTAVAIL:  # the address itself is not usable, not just this port
                _skip_unusable(host, exc)
            return False
    return True


def _skip_unusable(host: str, exc: OSError) -> NoReturn:
    pytest.skip(
        f"cannot bind loopback address {host}: {exc} (on Linux all of 127.0.0.0/8 is loopback and needs no "
        f"setup; elsewhere add the alias, e.g. `ifconfig lo0 alias {host}`)"
    )


def _keygen(path: Path) -> None:
    subprocess.run(
        [
            _find("ssh-keygen") or "ssh-keygen",
            "-q",
            "-t",
            "ed25519",
            "-N",
            "",
            "-C",
            "slipstream-test",
            "-f",
            str(path),
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )


def _write_config(
    root: Path, *, host: str, port: int, host_key: Path, authorized_keys: Path, marker: str
) -> Path:
    config = root / f"sshd_config-{host}"
    config.write_text(
        "\n".join(
            [
                f"ListenAddress {host}",
                f"Port {port}",
                f"HostKey {host_key}",
                f"PidFile {root / f'sshd-{host}.pid'}",
                f"AuthorizedKeysFile {authorized_keys}",
                "PubkeyAuthentication yes",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "PermitRootLogin prohibit-password",
                "StrictModes no",  # pytest's temp dirs live under world-writable /tmp, which StrictModes refuses
                "UsePAM no",
                "X11Forwarding no",
                "PrintMotd no",
                f"SetEnv {_MARKER_VAR}={marker}",  # marks every process started through the server
                "MaxStartups 50",  # the launcher may open several sessions at once
                "LogLevel INFO",
                "",
            ]
        )
    )
    return config


def _wait_until_accepting(proc: subprocess.Popen[bytes], host: str, port: int, log: Path) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"sshd for {host}:{port} exited with {proc.returncode} at start:\n"
                f"{log.read_text(errors='replace')}"
            )
        with socket.socket() as sock:
            sock.settimeout(0.5)
            if sock.connect_ex((host, port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(
        f"sshd for {host}:{port} did not accept connections within {_START_TIMEOUT_S} s:\n"
        f"{log.read_text(errors='replace')}"
    )


def _read_proc(pid: str, name: str) -> bytes:
    try:
        return (Path("/proc") / pid / name).read_bytes()
    except OSError:  # gone meanwhile, or not ours to read
        return b""


def processes_started_through(marker: str, *, listener_pids: Sequence[int] = ()) -> list[int]:
    """Live processes that came in through the servers: below a listener, or carrying `marker` in their
    environment (sshd's `SetEnv`), which finds them even after they were orphaned and reparented."""
    needle = f"{_MARKER_VAR}={marker}".encode()
    children: dict[int, list[int]] = {}
    found: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        stat = _read_proc(entry.name, "stat")
        with suppress(ValueError, IndexError):  # the command name may contain spaces or ')'
            children.setdefault(int(stat.rsplit(b")", 1)[1].split()[1]), []).append(int(entry.name))
        if needle in _read_proc(entry.name, "environ").split(b"\0"):
            found.add(int(entry.name))
    todo = list(listener_pids)
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return sorted(found)


def _stop(procs: Sequence[subprocess.Popen[bytes]], marker: str) -> None:
    """Kill whatever still runs through the servers (sessions, remote commands, orphans), then the servers."""
    listener_pids = [p.pid for p in procs]
    for _ in range(10):  # repeat: a process may fork between the snapshot and the kill
        left = processes_started_through(marker, listener_pids=listener_pids)
        if not left:
            break
        for pid in left:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def _start_all(
    root: Path, hosts: Sequence[str], *, host_key: Path, authorized: Path, marker: str
) -> tuple[int, list[subprocess.Popen[bytes]]]:
    """Start one sshd per host on a common port; retry with another port if one was taken meanwhile."""
    sshd = _find("sshd")
    assert sshd is not None  # checked by missing_requirement
    last_error: RuntimeError | None = None
    for _ in range(3):
        port = _pick_port(hosts)
        procs: list[subprocess.Popen[bytes]] = []
        try:
            for host in hosts:
                config = _write_config(
                    root, host=host, port=port, host_key=host_key, authorized_keys=authorized, marker=marker
                )
                log = root / f"sshd-{host}.log"
                with log.open("wb") as err:
                    # sshd insists on an absolute path (it re-executes itself for each connection)
                    procs.append(
                        subprocess.Popen(
                            [os.path.abspath(sshd), "-D", "-e", "-f", str(config)],
                            stdin=subprocess.DEVNULL,
                            stdout=err,
                            stderr=err,
                        )
                    )
                _wait_until_accepting(procs[-1], host, port, log)
            return port, procs
        except RuntimeError as exc:
            _stop(procs, marker)
            last_error = exc
            if "Address already in use" not in str(exc):
                raise
    assert last_error is not None
    raise last_error


@contextmanager
def sshd_servers(tmp_dir: Path, hosts: Sequence[str] = DEFAULT_HOSTS) -> Iterator[SshServers]:
    """Run one key-only sshd per address of `hosts` on a common free port for the duration of the block.

    Keys, configs, pid files and logs go to `tmp_dir/sshd`. Skips the calling test when this machine
    cannot run them (see `missing_requirement`). On exit every process started through the servers is
    killed, then the servers themselves.
    """
    reason = missing_requirement()
    if reason is not None:
        pytest.skip(reason)
    root = tmp_dir / "sshd"
    root.mkdir(parents=True, exist_ok=True)
    host_key, client_key = root / "host_ed25519", root / "client_ed25519"
    _keygen(host_key)
    _keygen(client_key)
    authorized = root / "authorized_keys"
    authorized.write_text(client_key.with_suffix(".pub").read_text())
    authorized.chmod(0o600)
    marker = uuid.uuid4().hex
    port, procs = _start_all(root, hosts, host_key=host_key, authorized=authorized, marker=marker)
    try:
        yield SshServers(
            hosts=tuple(hosts),
            port=port,
            key=client_key,
            user=getpass.getuser(),
            log_dir=root,
            marker=marker,
            listener_pids=tuple(p.pid for p in procs),
        )
    finally:
        _stop(procs, marker)

"""Run one command on every host of a hostfile at once over ssh (DeepSpeed's `ds_ssh`), as `slipstream ssh`.

Each host gets `ssh <launcher args> -o BatchMode=yes HOST <command>` (an argv list; the remote command is one
`shlex.join` string, never interpolated). Output lines are printed as they arrive, prefixed with the host;
each host's exit status is reported, and the overall status is 0 only when every host exited 0.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO

from slipstream.launcher.multinode import ssh_argv

__all__ = ["HostResult", "overall_status", "run_on_hosts"]


@dataclass(frozen=True, kw_only=True, slots=True)
class HostResult:
    host: str
    returncode: int


def _pump(host: str, stream: IO[str], out: IO[str], lock: threading.Lock) -> None:
    for line in stream:
        with lock:
            out.write(f"{host}: {line if line.endswith(chr(10)) else line + chr(10)}")
            out.flush()


def run_on_hosts(
    hosts: Sequence[str],
    command: Sequence[str],
    *,
    launcher_args: str = "",
    timeout_s: float | None = None,
    out: IO[str] | None = None,
) -> list[HostResult]:
    """Start `command` on every host in parallel, stream prefixed output to `out`, and wait for all of them.
    A host still running after `timeout_s` is killed and reported with exit status 124."""
    if not command:
        raise ValueError("slipstream ssh: no command given; write it after `--`, e.g. slipstream ssh -- hostname")
    out = out if out is not None else sys.stdout
    remote = shlex.join(command)
    lock = threading.Lock()
    procs, pumps = [], []
    for host in hosts:
        proc = subprocess.Popen(
            ssh_argv(host, command=remote, launcher_args=launcher_args),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
        procs.append(proc)
        pump = threading.Thread(target=_pump, args=(host, proc.stdout, out, lock), daemon=True)
        pump.start()
        pumps.append(pump)
    results = []
    for host, proc, pump in zip(hosts, procs, pumps, strict=True):
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            code = 124
        pump.join()
        results.append(HostResult(host=host, returncode=code))
    return results


def overall_status(results: Sequence[HostResult]) -> int:
    """0 when every host exited 0, else the first failing host's status (1 if that was a signal)."""
    for result in results:
        if result.returncode != 0:
            return result.returncode if result.returncode > 0 else 1
    return 0

"""How the tuner's runs are launched: a session that runs trial after trial in the same ranks (`Session`, the
default on one node), or one launch per run (`Relaunch`: across nodes, or when the user's launcher flags run a
module or a program, which the session cannot wrap).

Both take the script's argv (the script and its arguments, the config path already replaced) and give back a
`Ran`: the exit status (0: the run ended well; None: stopped past its time), the seconds and the run's own output.
A session whose run fails is stopped whole (its ranks may be stuck in a collective); the next run starts a new
one. See session.py for the rank side.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import IO, Protocol

from slipstream.autotuning.files import PROFILE_ENV, write_json
from slipstream.autotuning.session import POLL_S, SESSION_ENV, done_marker, order_path

__all__ = ["OOM_MARKERS", "Launches", "Ran", "Relaunch", "Session", "cause", "stop_group"]

OOM_MARKERS = ("out of memory", "OutOfMemoryError", "Cannot allocate memory", "MemoryError")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Ran:
    code: int | None
    seconds: float
    output: str


class Launches(Protocol):
    def run(self, script: list[str], *, profile: str, folder: Path) -> Ran: ...

    def close(self) -> None: ...


def cause(ran: Ran, *, timeout_s: float, where: Path) -> str:
    """Why a run gave no metrics, from its exit status and its output (`where`: its log, named in the text)."""
    if ran.code is None:
        return f"timeout after {timeout_s:.0f} s"
    if any(marker in ran.output for marker in OOM_MARKERS):
        return "out of memory"
    errors = [line.strip() for line in ran.output.splitlines() if "Error" in line or "error:" in line]
    detail = errors[-1][:200] if errors else f"see {where}"
    if ran.code == 0:
        return f"ended without metrics (did the script run past end_profile_step?); {detail}"
    return f"exit status {ran.code}: {detail}"


def stop_group(process: subprocess.Popen[bytes]) -> None:
    """Stop a launch with its whole process group (TERM, then KILL after 10 s)."""
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (PROFILE_ENV, SESSION_ENV)}
    env.update({k: v for k, v in extra.items() if v})
    return env


class Relaunch:
    """One launch per run, its output in `folder/log.txt`."""

    def __init__(self, launcher: list[str], *, timeout_s: float) -> None:
        self.launcher, self.timeout_s = launcher, timeout_s

    def run(self, script: list[str], *, profile: str, folder: Path) -> Ran:
        log = folder / "log.txt"
        started = time.perf_counter()
        with log.open("wb") as out:
            process = subprocess.Popen(
                [*self.launcher, *script],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=_env(**{PROFILE_ENV: profile}),
                start_new_session=True,
            )
            try:
                code: int | None = process.wait(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                stop_group(process)
                code = None
        seconds = time.perf_counter() - started
        return Ran(code=code, seconds=seconds, output=log.read_text(errors="replace"))

    def close(self) -> None:
        return None


class Session:
    """Runs in one launch of `python -m slipstream.autotuning.session` (see the module's docstring); each
    session's orders, markers and output are in `root/session<N>/`, each run's output also in `folder/log.txt`."""

    def __init__(self, launcher: list[str], *, root: Path, world: int, timeout_s: float) -> None:
        self.launcher, self.root, self.world, self.timeout_s = launcher, root, world, timeout_s
        self.process: subprocess.Popen[bytes] | None = None
        self.out: IO[bytes] | None = None
        self.folder, self.started, self.index = root, 0, 0

    def _start(self) -> subprocess.Popen[bytes]:
        self.started += 1
        self.folder, self.index = (self.root / f"session{self.started}").resolve(), 0
        self.folder.mkdir(parents=True, exist_ok=True)
        self.out = (self.folder / "log.txt").open("ab")
        self.process = subprocess.Popen(
            [*self.launcher, "--module", "slipstream.autotuning.session"],
            stdout=self.out,
            stderr=subprocess.STDOUT,
            env=_env(**{SESSION_ENV: str(self.folder)}),
            start_new_session=True,
        )
        return self.process

    def _wait(self, process: subprocess.Popen[bytes], started: float) -> int | None:
        markers = [done_marker(self.folder, self.index, rank) for rank in range(self.world)]
        while not all(marker.exists() for marker in markers):
            status = process.poll()
            if status is not None:
                return status or 1  # ended without finishing the order
            if time.perf_counter() - started > self.timeout_s:
                return None
            time.sleep(POLL_S)
        return 0

    def run(self, script: list[str], *, profile: str, folder: Path) -> Ran:
        process = self.process or self._start()
        log = self.folder / "log.txt"
        offset = log.stat().st_size
        started = time.perf_counter()
        write_json(order_path(self.folder, self.index), {"argv": script, "profile": profile})
        code = self._wait(process, started)
        seconds = time.perf_counter() - started
        if code == 0:
            self.index += 1
        else:
            self._end(stop=False)
        with log.open("rb") as text:
            text.seek(offset)
            output = text.read().decode(errors="replace")
        (folder / "log.txt").write_text(output)
        return Ran(code=code, seconds=seconds, output=output)

    def _end(self, *, stop: bool) -> None:
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            if stop:
                write_json(order_path(self.folder, self.index), {"stop": True})
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    stop_group(process)
            else:
                stop_group(process)
        if self.out is not None:
            self.out.close()
            self.out = None

    def close(self) -> None:
        """End the session: the stop order, or the process group after 30 s."""
        self._end(stop=True)

"""Multi-process test runner on gloo/CPU: `run_distributed` and the `@distributed` test decorator.

Ranks are spawned, so the rank function travels by reference: it must be a module-level function of an
importable module (test modules under tests/ are, with pytest's default import mode). Rendezvous is a
FileStore in a temp dir (no ports). A spawn costs a full `import torch` (~2 s on 2 cores): loop over a
grid of cases inside one spawn (`tests.harness.subtests.run_subtests`), not one spawn per parameter.
"""

from __future__ import annotations

import faulthandler
import functools
import importlib
import inspect
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from contextlib import suppress
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_ERROR_GRACE_S = 2.0  # after a rank fails, how long the others get to report before being killed
_STARTUP_S = 300.0
"""Budget for spawning, importing torch and meeting the other ranks; timeout_s starts only when every rank is
in `fn`. A spawn takes ~2 s on a quiet 2-core machine and tens of seconds on a loaded one: counting it in
timeout_s made short timeouts fail at random."""
_POLL_S = 0.2
RankFn = Callable[..., Any]  # fn(rank, world_size, **kwargs), module-level
Outcome = tuple[str, Any, float]  # ("ok", value, 0) | ("error", traceback, failed_at) | ("skip", reason, failed_at)


class DistributedTestError(RuntimeError):
    """A rank raised, crashed or returned something that cannot be sent back to the parent."""


class DistributedTimeoutError(DistributedTestError, TimeoutError):
    """One or more ranks were still running when timeout_s expired (or had not started within _STARTUP_S)."""

    startup_s: float | None = None
    """Seconds from the spawn until every rank was in `fn` (None: they never all got there)."""


def _call_decorated(module: str, name: str, *args: Any, **kwargs: Any) -> Any:
    """Find the undecorated function under the module-level `@distributed` test `module.name` and call it."""
    decorated = getattr(importlib.import_module(module), name)  # functools.wraps above us keeps the attribute
    return decorated.__slipstream_rank_fn__(*args, **kwargs)


_RENDEZVOUS_S = 120.0


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:  # reparented means the runner died: do not linger as an orphan
        time.sleep(1.0)
    os._exit(3)


def _failure(exc: BaseException) -> Outcome:
    if isinstance(exc, getattr(sys.modules.get("_pytest.outcomes"), "Skipped", ())):  # send reason, not exception
        return ("skip", str(exc.msg), time.time())
    return ("error", traceback.format_exc(), time.time())


def _rank_main(rank: int, world_size: int, payload: bytes, run_dir: str, parent_pid: int, timeout_s: float) -> None:
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    stack_file = open(os.path.join(run_dir, f"stack-{rank}.txt"), "w")  # noqa: SIM115 - faulthandler keeps it
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)  # parent asks for stacks at timeout
    os.environ["OMP_NUM_THREADS"] = "1"  # for anything this rank launches; torch itself is capped below
    torch.set_num_threads(1)
    try:
        fn, kwargs = pickle.loads(payload)
        store = dist.FileStore(os.path.join(run_dir, "store"), world_size)
        # The group's own timeout only bounds the rendezvous here (the parent enforces timeout_s once every rank
        # is in `fn`): at least _RENDEZVOUS_S, because ranks of a loaded machine start seconds apart and a 5 s
        # group timeout failed connectFullMesh on a rank started late.
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=max(timeout_s, _RENDEZVOUS_S)),
        )
        Path(run_dir, f"ready-{rank}").touch()  # the parent's timeout_s starts when every rank is here
        outcome = ("ok", fn(rank, world_size, **kwargs), 0.0)
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent as data
        outcome = _failure(exc)
    with suppress(Exception):  # a failing teardown must not hide the outcome
        dist.destroy_process_group()
    try:
        data = pickle.dumps(outcome)
    except Exception as exc:  # noqa: BLE001
        data = pickle.dumps(
            (
                "error",
                f"rank {rank} returned a value that cannot be pickled ({exc!r}); return tensors or plain Python data",
                time.time(),
            )
        )
    Path(run_dir, f"outcome-{rank}.tmp").write_bytes(data)
    os.replace(Path(run_dir, f"outcome-{rank}.tmp"), Path(run_dir, f"outcome-{rank}.pkl"))  # atomic for the reader


def _read_outcome(run_dir: str, rank: int, exitcode: int) -> Outcome:
    path = Path(run_dir, f"outcome-{rank}.pkl")
    if path.exists():
        return pickle.loads(path.read_bytes())
    return (
        "error",
        f"rank {rank} exited with code {exitcode} without reporting a result "
        "(killed by a signal, os._exit or a crash in native code)",
        time.time(),
    )


def _stacks(procs: Sequence[Any], ranks: Sequence[int], run_dir: str) -> str:
    for r in ranks:
        with suppress(ProcessLookupError):
            os.kill(procs[r].pid, signal.SIGUSR1)  # faulthandler in the rank dumps every thread's stack
    time.sleep(0.5)
    files = {r: Path(run_dir, f"stack-{r}.txt") for r in ranks}
    texts = {r: f.read_text(errors="replace")[-4000:] if f.exists() else "" for r, f in files.items()}
    return "\n".join(f"--- rank {r} Python stack at timeout ---\n{texts[r] or '(not started yet)'}" for r in ranks)


_MAX_LOAD_FACTOR = 8.0


def _load_factor() -> float:
    """How many times slower than on an idle machine a rank runs now: the 1-minute load average per core
    (at least 1, at most _MAX_LOAD_FACTOR). timeout_s is a hang detector, not a speed target: it counts seconds
    of an idle machine, so a run that shares the cores with other jobs gets proportionally more wall time
    (measured here: a 2-rank test at load 27 on 2 cores ran 10x slower and failed a fixed 120 s limit), while a
    real hang still fails within timeout_s x the load factor."""
    try:
        per_core = os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        return 1.0
    return min(max(per_core, 1.0), _MAX_LOAD_FACTOR)


def _wait_for_outcomes(procs: Sequence[Any], run_dir: str, timeout_s: float) -> tuple[dict[int, Outcome], float | None]:
    """Outcomes of the ranks that ended before the deadline: _STARTUP_S until every rank is ready, then
    timeout_s of idle-machine time (stretched by the load, _load_factor; shortened to _ERROR_GRACE_S once a rank
    has failed). Also returns the startup time."""
    n, started = len(procs), time.monotonic()
    outcomes: dict[int, Outcome] = {}
    deadline, ready_at = started + _STARTUP_S, None
    last, failed = started, False
    while len(outcomes) < n and time.monotonic() < deadline:
        now = time.monotonic()
        if ready_at is None and all(r in outcomes or Path(run_dir, f"ready-{r}").exists() for r in range(n)):
            ready_at, deadline = now, min(deadline, now + timeout_s)
        elif ready_at is not None and not failed:
            deadline += (now - last) * (1.0 - 1.0 / _load_factor())  # a starved run gets its CPU's worth of time
        last = now
        wait([p.sentinel for r, p in enumerate(procs) if r not in outcomes], max(0.0, min(deadline - now, _POLL_S)))
        for r, p in enumerate(procs):
            if r not in outcomes and p.exitcode is not None:
                outcomes[r] = _read_outcome(run_dir, r, p.exitcode)
                if outcomes[r][0] != "ok":
                    deadline, failed = min(deadline, time.monotonic() + _ERROR_GRACE_S), True
    return outcomes, None if ready_at is None else ready_at - started


def _collect(procs: Sequence[Any], run_dir: str, timeout_s: float) -> list[Any]:
    n = len(procs)
    outcomes, startup_s = _wait_for_outcomes(procs, run_dir, timeout_s)
    hung = [r for r in range(n) if r not in outcomes]
    bad = sorted((r for r in outcomes if outcomes[r][0] != "ok"), key=lambda r: outcomes[r][2])  # by time raised
    if bad and outcomes[bad[0]][0] == "skip":
        import pytest  # only the parent needs it, and it runs under pytest

        pytest.skip(f"rank {bad[0]}: {outcomes[bad[0]][1]}")
    if bad:
        details = "\n".join(f"--- rank {r} ({outcomes[r][0]}) ---\n{outcomes[r][1]}" for r in bad)
        raise DistributedTestError(
            f"rank {bad[0]} of {n} failed first (failed: {bad}, finished: {sorted(outcomes)}, killed after the "
            f"failure: {hung}); later failures are often fallout of the first one\n{details}"
        )
    if hung:
        when = (
            f"after timeout_s={timeout_s}"
            if startup_s is not None
            else f"without starting within {_STARTUP_S:g} s (spawn, import, meeting the other ranks)"
        )
        error = DistributedTimeoutError(
            f"rank(s) {hung} of {n} still running {when} (finished: {sorted(outcomes)}); "
            "a rank that skips or reorders a collective hangs its peers; fix the schedule or raise timeout_s\n"
            + _stacks(procs, hung, run_dir)
        )
        error.startup_s = startup_s
        raise error
    return [outcomes[r][1] for r in range(n)]


def _kill(procs: Sequence[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()  # SIGKILL: a rank stuck in a gloo wait may ignore SIGTERM; nothing in it needs cleanup
    for p in procs:
        p.join()


def run_distributed(
    fn: RankFn,
    *,
    world_size: int = 2,
    timeout_s: float = 120.0,
    tmp_dir: str | os.PathLike[str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run `fn(rank, world_size, **kwargs)` on `world_size` spawned gloo ranks; return the per-rank results.

    `fn` must be module-level and `kwargs` picklable. The FileStore goes in a fresh directory under
    `tmp_dir` (default: the system temp dir), removed afterwards. Raises DistributedTestError with the
    first failing rank's traceback, DistributedTimeoutError naming the hung ranks with their stacks,
    or pytest's skip exception if a rank skipped first. No rank outlives the call.
    """
    if world_size < 1:
        raise ValueError(f"run_distributed: world_size={world_size} must be >= 1 (2 is usual, 4 at most on 2 cores)")
    try:
        payload = pickle.dumps((fn, kwargs))
    except Exception as exc:
        raise TypeError(
            f"run_distributed: {fn!r} or kwargs {sorted(kwargs)} cannot be pickled ({exc}); ranks "
            "re-import fn by name, so define it at module level (no lambda or nested function) and "
            "pass plain data (tensors, numbers, str paths)"
        ) from exc
    if tmp_dir is not None:
        os.makedirs(tmp_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="slipstream-dist-", dir=tmp_dir) as run_dir:
        procs = [
            mp.get_context("spawn").Process(
                target=_rank_main,
                name=f"slipstream-rank-{r}",
                args=(r, world_size, payload, run_dir, os.getpid(), timeout_s),
            )
            for r in range(world_size)
        ]
        try:
            for p in procs:
                p.start()
            return _collect(procs, run_dir, timeout_s)
        finally:
            _kill(procs)


def distributed(*, world_size: int = 2, timeout_s: float = 120.0) -> Callable[[RankFn], Callable[..., None]]:
    """Turn a module-level `def test_x(rank, world_size, <fixtures>...)` into a pytest test run on `world_size` ranks.

    pytest sees only the fixture parameters, which are passed to every rank and must be picklable
    (tmp_path is); the FileStore goes under pytest's tmp dir through an added `tmp_path_factory`.
    """

    def decorate(fn: RankFn) -> Callable[..., None]:
        params = list(inspect.signature(fn).parameters.values())
        names = [p.name for p in params]
        if names[:2] != ["rank", "world_size"] or "tmp_path_factory" in names or "<locals>" in fn.__qualname__:
            raise TypeError(
                f"@distributed: {fn.__qualname__} must be a module-level function whose first two "
                f"parameters are (rank, world_size), not using tmp_path_factory (unpicklable); got {names}"
            )
        ref = functools.partial(_call_decorated, fn.__module__, fn.__qualname__)

        @functools.wraps(fn)
        def wrapper(**fixture_values: Any) -> None:
            tmp_dir = fixture_values.pop("tmp_path_factory").mktemp("dist")
            run_distributed(ref, world_size=world_size, timeout_s=timeout_s, tmp_dir=tmp_dir, **fixture_values)

        fixtures = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in params[2:]]
        fixtures.append(inspect.Parameter("tmp_path_factory", inspect.Parameter.KEYWORD_ONLY))
        wrapper.__signature__ = inspect.Signature(fixtures)  # type: ignore[attr-defined]
        wrapper.__slipstream_rank_fn__ = fn  # type: ignore[attr-defined]
        return wrapper

    return decorate

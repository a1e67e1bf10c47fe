"""Multi-process test runner on gloo/CPU: spawn ranks, rendezvous through a FileStore, collect results.

Owns `run_distributed`, the `@distributed` test decorator and `run_subtests`. Rank functions are
sent to children by reference (spawn re-imports their module), so they must be module-level
functions in an importable module (a test module under tests/ is fine with pytest's default import
mode); lambdas, closures and nested functions are rejected before anything is spawned.

Spawning a rank costs a full `import torch` (~2-3 s on 2 cores), so run a grid of cases inside one
spawn instead of one spawn per pytest parameter (the FSDP2 `run_subtests` pattern)::

    def _check_bucketing(rank: int, world_size: int) -> None:
        run_subtests(subtest_grid(bucket_size=[7, 64], dtype=[torch.float32, torch.bfloat16]),
                     functools.partial(_one_case, rank=rank))

    def test_bucketing() -> None:
        run_distributed(_check_bucketing, world_size=2)
"""

from __future__ import annotations

import faulthandler
import functools
import importlib
import inspect
import itertools
import os
import pickle
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_ERROR_GRACE_S = 2.0  # after a rank fails, how long the others get to report before being killed
Outcome = tuple[str, Any]  # ("ok", value) | ("error", traceback text) | ("skip", reason)


class DistributedTestError(RuntimeError):
    """A rank raised, crashed or returned something that cannot be sent back to the parent."""


class DistributedTimeoutError(DistributedTestError, TimeoutError):
    """One or more ranks were still running when timeout_s expired."""


class SubtestError(AssertionError):
    """One case of a `run_subtests` grid failed; the message names the case."""


@dataclass(frozen=True)
class _RankFnRef:
    """Picklable pointer to the undecorated function under a module-level `@distributed` test."""

    module: str
    qualname: str

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        obj: Any = importlib.import_module(self.module)
        for part in self.qualname.split("."):
            obj = getattr(obj, part)
        while not hasattr(obj, "__slipstream_rank_fn__"):
            obj = obj.__wrapped__
        return obj.__slipstream_rank_fn__(*args, **kwargs)


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:  # reparented means the runner died: do not linger as an orphan
        time.sleep(1.0)
    os._exit(3)


def _is_skip(exc: BaseException) -> bool:
    return type(exc).__name__ == "Skipped" and type(exc).__module__ == "_pytest.outcomes"


def _rank_main(rank: int, world_size: int, payload: bytes, run_dir: str, parent_pid: int, timeout_s: float) -> None:
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    stack_file = open(os.path.join(run_dir, f"stack-{rank}.txt"), "w")  # noqa: SIM115 - lives as long as the rank
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    torch.set_num_threads(1)
    outcome: Outcome
    try:
        fn, kwargs = pickle.loads(payload)
        store = dist.FileStore(os.path.join(run_dir, "store"), world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        try:
            outcome = ("ok", fn(rank, world_size, **kwargs))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent as data
        outcome = ("skip", str(getattr(exc, "msg", exc))) if _is_skip(exc) else ("error", traceback.format_exc())
    try:
        data = pickle.dumps(outcome)
    except Exception as exc:  # noqa: BLE001
        data = pickle.dumps(("error", f"rank {rank} returned a value that cannot be pickled ({exc!r}); "
                                      "return tensors or plain Python data"))
    path = os.path.join(run_dir, f"outcome-{rank}.pkl")
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)


def _read_outcome(run_dir: str, rank: int, exitcode: int) -> Outcome:
    try:
        with open(os.path.join(run_dir, f"outcome-{rank}.pkl"), "rb") as f:
            return pickle.load(f)
    except FileNotFoundError:
        return ("error", f"rank {rank} exited with code {exitcode} without reporting a result "
                         "(killed by a signal, os._exit or a crash in native code)")


@contextmanager
def _child_env() -> Iterator[None]:
    """Spawned children inherit os.environ at start; default them to one OpenMP thread each."""
    previous = os.environ.get("OMP_NUM_THREADS")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("OMP_NUM_THREADS", None)


def _stacks(procs: Sequence[Any], ranks: Sequence[int], run_dir: str) -> str:
    for r in ranks:
        try:
            os.kill(procs[r].pid, signal.SIGUSR1)  # faulthandler in the rank dumps every thread's stack
        except ProcessLookupError:
            pass
    time.sleep(0.5)
    parts = []
    for r in ranks:
        try:
            with open(os.path.join(run_dir, f"stack-{r}.txt"), errors="replace") as f:
                text = f.read()[-4000:]
        except FileNotFoundError:
            text = ""
        parts.append(f"--- rank {r} Python stack at timeout ---\n{text or '(rank had not started running yet)'}")
    return "\n".join(parts)


def _collect(procs: Sequence[Any], run_dir: str, timeout_s: float) -> list[Any]:
    n = len(procs)
    deadline = time.monotonic() + timeout_s
    outcomes: dict[int, Outcome] = {}
    order: list[int] = []  # ranks in the order they finished
    while len(outcomes) < n and time.monotonic() < deadline:
        wait([p.sentinel for r, p in enumerate(procs) if r not in outcomes], deadline - time.monotonic())
        for r, p in enumerate(procs):
            if r not in outcomes and p.exitcode is not None:
                outcomes[r] = _read_outcome(run_dir, r, p.exitcode)
                order.append(r)
                if outcomes[r][0] != "ok" and all(outcomes[q][0] == "ok" for q in order[:-1]):
                    deadline = min(deadline, time.monotonic() + _ERROR_GRACE_S)
    hung = [r for r in range(n) if r not in outcomes]
    bad = [r for r in order if outcomes[r][0] != "ok"]
    if bad and outcomes[bad[0]][0] == "skip":
        import pytest  # the parent runs under pytest; children never import it for us

        pytest.skip(f"rank {bad[0]}: {outcomes[bad[0]][1]}")
    if bad:
        details = "\n".join(f"--- rank {r} ({outcomes[r][0]}) ---\n{outcomes[r][1]}" for r in bad)
        raise DistributedTestError(
            f"rank {bad[0]} of {n} failed first (failed: {bad}, finished: {sorted(outcomes)}, killed after the "
            f"failure: {hung}); later failures are often fallout of the first one\n{details}")
    if hung:
        raise DistributedTimeoutError(
            f"rank(s) {hung} of {n} still running after timeout_s={timeout_s} (finished: {sorted(outcomes)}); "
            "a rank that skips or reorders a collective hangs its peers; fix the schedule or raise timeout_s\n"
            + _stacks(procs, hung, run_dir))
    return [outcomes[r][1] for r in range(n)]


def _kill(procs: Sequence[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join()


def run_distributed(fn: Callable[..., Any], *, world_size: int = 2, timeout_s: float = 120.0,
                    tmp_dir: str | os.PathLike[str] | None = None, **kwargs: Any) -> list[Any]:
    """Run `fn(rank, world_size, **kwargs)` on `world_size` spawned gloo ranks; return each rank's result.

    `fn` must be a module-level function and `kwargs` picklable. The FileStore lives in a fresh
    directory under `tmp_dir` (default: the system temp dir), removed afterwards. Raises
    DistributedTestError naming the first failing rank with its traceback, DistributedTimeoutError
    naming the hung ranks (with their stacks), or pytest's skip exception if a rank skipped first.
    All children are dead when this returns or raises.
    """
    if world_size < 1:
        raise ValueError(f"run_distributed: world_size={world_size} must be >= 1 (2 is the default, 4 the most "
                         "a 2-core machine handles)")
    if "<locals>" in getattr(fn, "__qualname__", "") or getattr(fn, "__name__", "") == "<lambda>":
        raise TypeError(f"run_distributed: {fn!r} is a lambda or nested function; spawned ranks re-import it by "
                        "name, so define it at module level")
    try:
        payload = pickle.dumps((fn, kwargs))
    except Exception as exc:
        raise TypeError(f"run_distributed: {fn!r} or kwargs {sorted(kwargs)} cannot be pickled ({exc}); pass "
                        "module-level functions and plain data (tensors, numbers, paths)") from exc
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="slipstream-dist-", dir=tmp_dir) as run_dir:
        procs = [ctx.Process(target=_rank_main, name=f"slipstream-rank-{r}",
                             args=(r, world_size, payload, run_dir, os.getpid(), timeout_s))
                 for r in range(world_size)]
        try:
            with _child_env():
                for p in procs:
                    p.start()
            return _collect(procs, run_dir, timeout_s)
        finally:
            _kill(procs)


def distributed(*, world_size: int = 2, timeout_s: float = 120.0) -> Callable[[Callable[..., Any]], Callable[..., None]]:
    """Turn a module-level `def test_x(rank, world_size, <fixtures>...)` into a pytest test run on `world_size` ranks.

    pytest sees only the fixture parameters (which must be picklable, e.g. tmp_path); the FileStore
    goes under pytest's tmp dir via a hidden `tmp_path_factory` request.
    """

    def decorate(fn: Callable[..., Any]) -> Callable[..., None]:
        params = list(inspect.signature(fn).parameters.values())
        if [p.name for p in params[:2]] != ["rank", "world_size"] or "<locals>" in fn.__qualname__:
            raise TypeError(f"@distributed: {fn.__qualname__} must be a module-level function whose first two "
                            f"parameters are (rank, world_size); got {[p.name for p in params[:2]]}")
        fixtures = params[2:]
        hidden = "tmp_path_factory" not in {p.name for p in fixtures}
        ref = _RankFnRef(fn.__module__, fn.__qualname__)

        @functools.wraps(fn)
        def wrapper(**fixture_values: Any) -> None:
            factory = fixture_values.pop("tmp_path_factory") if hidden else fixture_values["tmp_path_factory"]
            run_distributed(ref, world_size=world_size, timeout_s=timeout_s,
                            tmp_dir=factory.mktemp("dist"), **fixture_values)

        extra = [inspect.Parameter("tmp_path_factory", inspect.Parameter.KEYWORD_ONLY)] if hidden else []
        wrapper.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in fixtures] + extra)
        wrapper.__slipstream_rank_fn__ = fn  # type: ignore[attr-defined]
        return wrapper

    return decorate


def subtest_grid(**axes: Sequence[Any]) -> list[dict[str, Any]]:
    """Cartesian product of keyword axes: subtest_grid(a=[1, 2], b=[3]) -> [{'a': 1, 'b': 3}, {'a': 2, 'b': 3}]."""
    return [dict(zip(axes, values)) for values in itertools.product(*axes.values())]


def run_subtests(cases: Iterable[Mapping[str, Any]], fn: Callable[..., Any]) -> list[Any]:
    """Run `fn(**case)` for each case inside the current rank; a failure raises SubtestError naming the case."""
    cases = list(cases)
    results = []
    for i, case in enumerate(cases):
        try:
            results.append(fn(**case))
        except Exception as exc:
            raise SubtestError(f"subtest {i + 1}/{len(cases)} failed for case {dict(case)!r}: "
                               f"{type(exc).__name__}: {exc}") from exc
    return results

"""pytest plugin for the DeepSpeed acceptance suite (loaded by run.py with `-p suite_plugin`).

Inside the pytest process that runs DeepSpeed's tests it:
- `--suite-ids FILE`: runs only the listed test ids (the Slipstream side runs only what DeepSpeed passed);
- `--suite-skip-ids FILE`: leaves out ids already reported (the runner resumes a run after a hung test);
- `--suite-select FILE`: runs only the tests under the listed paths or node-id prefixes (a folder row that names
  classes of a module which belongs to another row);
- `--suite-max-params N`: keeps at most N parametrizations of each test function (collection order), so the
  run stays affordable on a 2-core machine (some DeepSpeed tests have 100+ parametrizations);
- `--suite-report FILE`: appends one JSON line per finished test: {"id", "outcome", "seconds", "message"}, and
  one per module that failed to import; lines are written as tests finish, so a cut run keeps its results;
- `--suite-preload MODULES`: has multiprocessing's forkserver import these modules once, so the ranks that
  DeepSpeed's DistributedTest starts for every test are forked with torch and `deepspeed` already imported
  (seconds per test instead of an interpreter start and a torch import per rank);
- `--suite-hard-timeout S`: a watchdog for tests that hang past pytest-timeout (a hung rank blocks the
  DistributedTest's own teardown): it records the test as failed, kills the processes this pytest started
  (its descendants, found through /proc) and exits with status 70; run.py then resumes after that test.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

HUNG_EXIT = 70
_OUTCOME_RANK = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}


def pytest_addoption(parser):
    group = parser.getgroup("slipstream-suite")
    group.addoption("--suite-ids", default=None, help="file of test ids to run (one per line)")
    group.addoption("--suite-skip-ids", default=None, help="file of test ids to leave out (already reported)")
    group.addoption("--suite-select", default=None, help="file of paths / node-id prefixes whose tests run")
    group.addoption("--suite-preload", default="", help="comma-separated modules the forkserver imports once")
    group.addoption("--suite-max-params", type=int, default=0, help="parametrizations kept per test (0: all)")
    group.addoption("--suite-report", default=None, help="JSON-lines file the outcomes are appended to")
    group.addoption("--suite-hard-timeout", type=float, default=0.0, help="seconds before a test is killed")


def _read_ids(path: str) -> set[str]:
    with open(path, encoding="utf-8") as handle:
        return {line.strip() for line in handle if line.strip() and not line.startswith("#")}


def _family(item) -> str:
    """The test function an item is a parametrization of: its id without the [params] part."""
    return item.nodeid.split("[", 1)[0]


def _under(nodeid: str, prefixes: set[str]) -> bool:
    """Whether a test id is one of `prefixes` or lies under one (a folder, a module, a class, a function)."""
    return any(nodeid == p or nodeid.startswith((p + "/", p + "::", p + "[")) for p in prefixes)


def pytest_collection_modifyitems(session, config, items):
    ids_file = config.getoption("suite_ids")
    max_params = config.getoption("suite_max_params")
    kept = list(items)
    select_file = config.getoption("suite_select")
    if select_file:
        prefixes = {p.rstrip("/") for p in _read_ids(select_file)}
        kept = [item for item in kept if _under(item.nodeid, prefixes)]
    if ids_file:
        wanted = _read_ids(ids_file)
        kept = [item for item in kept if item.nodeid in wanted]
    elif max_params > 0:
        seen: dict[str, int] = {}
        chosen = []
        for item in kept:
            family = _family(item)
            seen[family] = seen.get(family, 0) + 1
            if seen[family] <= max_params:
                chosen.append(item)
        kept = chosen
    skip_file = config.getoption("suite_skip_ids")
    if skip_file:
        done = _read_ids(skip_file)
        kept = [item for item in kept if item.nodeid not in done]
    kept_set = set(kept)
    deselected = [item for item in items if item not in kept_set]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
    items[:] = kept


# ----------------------------------------------------------------------------------------------- watchdog
def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as handle:
                stat = handle.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill_descendants() -> int:
    me = os.getpid()
    killed = 0
    for pid in _descendants(me):
        try:
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except OSError:
            pass
    return killed


def _hung(config, nodeid: str, limit: float) -> None:
    config._suite_outcomes[nodeid] = ("failed", f"hung: still running after {limit:g} s (killed)")
    _write(config, nodeid)
    _kill_descendants()
    os._exit(HUNG_EXIT)


def pytest_configure(config):
    _CONFIG[:] = [config]
    config._suite_started = {}
    config._suite_outcomes = {}
    preload = [m for m in (config.getoption("suite_preload") or "").split(",") if m]
    if preload:
        import multiprocessing

        multiprocessing.set_forkserver_preload(preload)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    limit = item.config.getoption("suite_hard_timeout")
    timer = None
    if limit > 0:
        timer = threading.Timer(limit, _hung, args=(item.config, item.nodeid, limit))
        timer.daemon = True
        timer.start()
    item.config._suite_started[item.nodeid] = time.monotonic()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()
        _write(item.config, item.nodeid)


def pytest_collectreport(report):
    """A module that fails to import, or skips itself at import, yields no tests: record why, under the
    module's path (a skipped module reads as one skipped test)."""
    if (report.failed or report.skipped) and report.nodeid:
        path = _report_path_from_config()
        if path:
            if report.failed:
                outcome, message = "collect-error", _short(report.longreprtext)
            else:
                longrepr = report.longrepr
                outcome, message = "skipped", str(longrepr[2] if isinstance(longrepr, tuple) else longrepr)
            line = {"id": report.nodeid, "outcome": outcome, "seconds": 0, "message": message}
            with open(path, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(line) + "\n")


_CONFIG = []


def _report_path_from_config():
    return _CONFIG[0].getoption("suite_report") if _CONFIG else None


@pytest.hookimpl(tryfirst=True)
def pytest_report_teststatus(report, config):
    outcome = report.outcome
    if report.when != "call" and outcome == "failed":
        outcome = "error"
    if report.when == "teardown" and outcome == "passed":
        return None
    previous = config._suite_outcomes.get(report.nodeid)
    message = ""
    if outcome in ("failed", "error"):
        message = _short(report.longreprtext)
    elif outcome == "skipped" and isinstance(report.longrepr, tuple):
        message = str(report.longrepr[2])
    if previous is None or _OUTCOME_RANK[outcome] > _OUTCOME_RANK[previous[0]]:
        config._suite_outcomes[report.nodeid] = (outcome, message)
    return None


def _short(text: str) -> str:
    """The last line of a failure that names an exception ("E   ..."), else the last line."""
    lines = [line for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("E ")]
    chosen = errors[-1] if errors else (lines[-1] if lines else "")
    return chosen[2:].strip()[:300] if chosen.startswith("E ") else chosen.strip()[:300]


def _write(config, nodeid: str) -> None:
    path = config.getoption("suite_report")
    outcome, message = config._suite_outcomes.get(nodeid, ("error", "no report (crashed before setup)"))
    started = config._suite_started.pop(nodeid, time.monotonic())
    if path:
        line = {"id": nodeid, "outcome": outcome, "seconds": round(time.monotonic() - started, 2), "message": message}
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(line) + "\n")

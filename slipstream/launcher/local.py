"""The per-node launch: start this node's ranks through PyTorch's elastic agent, watch them, report failures.

Owns everything that happens on one node. `run_node(plan, node_rank=N)` calls
`torch.distributed.launcher.api.elastic_launch` in this process (not a `torchrun` subprocess, so the
failure it raises names the rank, pid and exit code, and the log paths are ours) with

- one worker per slot of host `N` of the world; each worker runs `python -u rank_exec.py ... -- COMMAND`
  (see rank_exec.py), which adds `LOCAL_SIZE`, `CROSS_RANK`, `CROSS_SIZE`, the visible-device variable
  (`CUDA_VISIBLE_DEVICES=<this host's slots>` on CUDA, so a user-set list on one node selects the
  devices), core binding, and `--local_rank=N`, then execs the user's program. The agent itself sets
  `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `GROUP_RANK`, `MASTER_ADDR`, `MASTER_PORT`;
- rendezvous `static` at `master_addr:master_port` with this node's rank and no restarts, or, with
  `--elastic_training`, `c10d` there with `min_nodes..max_nodes` and `max_restarts` (DeepSpeed: 100);
- every rank's stdout and stderr written, in order, to `<log_dir>/<timestamp>_rank<R>.log`
  (`..._rank<R>.restart<K>.log` after a restart) and teed to the console with a `[rank<R>]:` prefix (the
  only one: rank_exec.py tells the rank, and init_distributed drops the one torch's excepthook adds).
  Without `--enable_each_rank_log` the directory is a fresh temp dir, removed after a clean exit and
  kept (and named) when anything failed.

When a rank exits non-zero the agent stops every other local rank (SIGTERM to its process group, followed
by SIGCONT so that a rank stopped by SIGSTOP acts on it too (`torch_shim.continue_stopped_ranks_on_close`),
then SIGKILL after a grace period: torch 2.13's agent uses 30 s there, not `SHUTDOWN_TIMEOUT_S`, which
applies when the launcher itself is signalled); we then print host, rank, exit code and the last `TAIL_LINES`
lines of that rank's log, and return the exit code (non-zero). The rank named is never one the agent stopped
itself (`torch_shim.pids_stopped_by_agent`): a rank ended by a SIGTERM from outside the job is named, not a
survivor the agent sent SIGTERM to. SIGINT/SIGTERM/SIGHUP/SIGQUIT to this
process reach every rank through the agent, and we return 128 + the signal number.

Elastic restarts start the ranks again from the beginning of the script; resuming from the newest
checkpoint needs Slipstream's checkpoint feature (not written yet), after which a script that calls
`load_checkpoint` at start resumes where the last complete save left off.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from slipstream.launcher.plan import LaunchPlan

TAIL_LINES = 20
SHUTDOWN_TIMEOUT_S = 10
RANK_EXEC = str(Path(__file__).resolve().with_name("rank_exec.py"))


def _log_specs_class() -> type:
    """Build the LogsSpecs subclass lazily, so importing this module does not import torch."""
    from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs

    class RankLogsSpecs(LogsSpecs):
        """One merged log file per global rank, named like DeepSpeed's `<timestamp>_rank<N>.log`."""

        def __init__(self, log_dir: str, stamp: str) -> None:
            super().__init__(log_dir=log_dir)
            self.stamp = stamp
            self.paths: dict[int, str] = {}

        @property
        def root_log_dir(self) -> str:
            return str(self._root_log_dir)

        def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
            stdouts: dict[int, str] = {}
            for local_rank, env in envs.items():
                rank, restart = int(env["RANK"]), int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
                suffix = f".restart{restart}" if restart else ""
                stdouts[local_rank] = os.path.join(self.root_log_dir, f"{self.stamp}_rank{rank}{suffix}.log")
                self.paths[rank] = stdouts[local_rank]
            return LogsDest(
                stdouts=stdouts,
                stderrs={local_rank: "" for local_rank in envs},
                tee_stdouts=dict(stdouts),
                tee_stderrs={},
                error_files={
                    local_rank: path.removesuffix(".log") + ".error.json" for local_rank, path in stdouts.items()
                },
            )

    return RankLogsSpecs


def rank_exec_args(plan: LaunchPlan, *, host: str) -> list[str]:
    """Arguments after `python` for each worker: `-u rank_exec.py [options] -- COMMAND...`."""
    args = ["-u", RANK_EXEC, "--mode", plan.program.mode, "--merge_stderr"]
    if plan.program.no_local_rank:
        args.append("--no_local_rank")
    if plan.ranks.bind_cores:
        args.append("--bind_cores")
        if plan.ranks.core_list:
            args += ["--core_list", plan.ranks.core_list]
    if plan.ranks.visible_envs:
        args += ["--visible_devices", ",".join(str(slot) for slot in plan.world[host])]
        for name in plan.ranks.visible_envs:
            args += ["--visible_env", name]
    return [*args, "--", *plan.program.command]


def read_tail(path: str, lines: int = TAIL_LINES) -> list[str]:
    """The last `lines` lines of a log file (empty when it does not exist)."""
    try:
        with open(path, errors="replace") as handle:
            return handle.read().splitlines()[-lines:]
    except OSError:
        return []


def _ended_by_agent(failure: object, stopped_by_agent: frozenset[int]) -> bool:
    return int(getattr(failure, "pid", -1)) in stopped_by_agent


def _root_cause_first(failures: Mapping[int, object], *, stopped_by_agent: frozenset[int]) -> list[tuple[int, object]]:
    """Failures ordered so the cause leads. The ranks the agent stopped itself (`stopped_by_agent`: their pids,
    signalled while they still ran) come last: they never cause a failure, whatever signal ended them. Of the
    others, a death by a signal from outside the job (an OOM killer, a scheduler, a crash) leads, then a non-zero
    exit or an abort: a rank that exits with an error soon after a peer vanished is usually reporting that peer.
    Earliest first, then lowest rank, within each group."""

    def key(item: tuple[int, object]) -> tuple[int, float, int]:
        code = int(getattr(item[1], "exitcode", 1))
        if _ended_by_agent(item[1], stopped_by_agent):
            group = 2
        else:
            group = 0 if code < 0 and code != -signal.SIGABRT else 1
        return group, float(getattr(item[1], "timestamp", 0)), item[0]

    return sorted(failures.items(), key=key)


def describe_failures(
    failures: Mapping[int, object], *, host: str, paths: dict[int, str], stopped_by_agent: frozenset[int]
) -> str:
    """Host, rank, exit code and log tail of the failed rank, then one line per other rank that ended."""
    ordered = _root_cause_first(failures, stopped_by_agent=stopped_by_agent)
    out: list[str] = []
    for index, (rank, failure) in enumerate(ordered):
        code = int(getattr(failure, "exitcode", 1))
        how = f"exit code {code}" if code >= 0 else f"signal {failure.signal_name()}"  # type: ignore[attr-defined]
        path = paths.get(rank, "?")
        if index == 0:
            verb = "failed"
        elif _ended_by_agent(failure, stopped_by_agent):
            verb = "was stopped by the launcher and ended"
        else:
            verb = "also ended"
        out.append(
            f"slipstream: host {host} rank {rank} (local rank {getattr(failure, 'local_rank', '?')}) "
            f"{verb} with {how}; log: {path}"
        )
        if index == 0:
            tail = read_tail(path)
            out.append(f"----- last {len(tail)} lines of rank {rank} on {host} -----")
            out += tail
            out.append(f"----- end of rank {rank} -----")
    out.append("slipstream: the other ranks of this node were stopped")
    return "\n".join(out)


def exit_code_of(failures: Mapping[int, object], *, stopped_by_agent: frozenset[int]) -> int:
    """The launcher's exit code: the failed rank's code, 128+N for signal N, never 0."""
    first = _root_cause_first(failures, stopped_by_agent=stopped_by_agent)[0][1]
    code = int(getattr(first, "exitcode", 1))
    return code if code > 0 else (128 - code if code < 0 else 1)


def launch_config(plan: LaunchPlan, *, node_rank: int, log_specs: object) -> object:
    """The `LaunchConfig` of this node: static rendezvous, or c10d with restarts when elastic."""
    from torch.distributed.launcher.api import LaunchConfig

    rdzv = plan.rendezvous
    host = list(plan.world)[node_rank]
    endpoint = f"{rdzv.master_addr}:{rdzv.master_port}"
    common: dict[str, object] = {
        "nproc_per_node": len(plan.world[host]),
        "logs_specs": log_specs,
        "rdzv_endpoint": endpoint,
        "log_line_prefix_template": "[rank${rank}]:",
        "shutdown_timeout": SHUTDOWN_TIMEOUT_S,
        "monitor_interval": 0.1,
    }
    # torch adds LaunchConfig fields over releases (shutdown_timeout is missing from 2.11's): pass the ones this
    # torch knows; without shutdown_timeout its agent keeps its own grace period before SIGKILL
    known = {field.name for field in dataclasses.fields(LaunchConfig)}
    common = {key: value for key, value in common.items() if key in known}
    if rdzv.elastic:
        return LaunchConfig(
            min_nodes=rdzv.min_nodes if rdzv.min_nodes > 0 else plan.num_nodes,
            max_nodes=rdzv.max_nodes if rdzv.max_nodes > 0 else plan.num_nodes,
            run_id=os.environ.get("ELASTIC_RUN_ID", "123456789"),
            rdzv_backend="c10d",
            max_restarts=rdzv.max_restarts,
            **common,  # type: ignore[arg-type]
        )
    return LaunchConfig(
        min_nodes=plan.num_nodes,
        max_nodes=plan.num_nodes,
        run_id="slipstream",
        rdzv_backend="static",
        rdzv_configs={"rank": node_rank, "timeout": 900},
        max_restarts=0,
        **common,  # type: ignore[arg-type]
    )


def run_node(plan: LaunchPlan, *, node_rank: int) -> int:
    """Run this node's ranks to completion; return 0, the failed rank's exit code, or 128+signal."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    from slipstream.utils.torch_shim import continue_stopped_ranks_on_close, pids_stopped_by_agent

    continue_stopped_ranks_on_close()
    if not 0 <= node_rank < plan.num_nodes:
        raise ValueError(f"--node_rank {node_rank} is outside 0..{plan.num_nodes - 1} for hosts {list(plan.world)}")
    host = list(plan.world)[node_rank]
    temporary = plan.ranks.log_dir is None
    log_dir = tempfile.mkdtemp(prefix="slipstream-logs-") if temporary else str(plan.ranks.log_dir)
    os.makedirs(log_dir, exist_ok=True)
    specs = _log_specs_class()(log_dir, time.strftime("%Y%m%d%H%M%S"))
    print(
        f"slipstream: host {host} (node {node_rank}/{plan.num_nodes}) starts {len(plan.world[host])} rank(s) "
        f"of {plan.world_size}; per-rank logs in {log_dir}",
        flush=True,
    )
    config = launch_config(plan, node_rank=node_rank, log_specs=specs)
    try:
        elastic_launch(config, sys.executable)(*rank_exec_args(plan, host=host))  # type: ignore[arg-type]
    except ChildFailedError as error:
        sys.stdout.flush()
        stopped = pids_stopped_by_agent()
        report = describe_failures(error.failures, host=host, paths=specs.paths, stopped_by_agent=stopped)
        print(report, file=sys.stderr, flush=True)
        return exit_code_of(error.failures, stopped_by_agent=stopped)
    except SignalException as error:
        print(
            f"slipstream: host {host} got {error.sigval.name}; stopped every rank of this node (logs in {log_dir})",
            file=sys.stderr,
            flush=True,
        )
        return 128 + int(error.sigval)
    if temporary:
        shutil.rmtree(log_dir, ignore_errors=True)
    return 0

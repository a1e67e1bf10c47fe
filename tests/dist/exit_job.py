"""Run a tiny 2-rank ZeRO-2 job many times and report how each rank process ended.

`python exit_job.py --runs N --endings return,destroy,exit,raise` imports torch and Slipstream once, then per
run forks two rank processes that join a fresh process group (env://, rank 0 hosts the store), train two
steps and end the way that run's ending says, through the interpreter's own exit:

- return: fall off the end of the script;  destroy: call destroy_process_group() first;
- keep: fall off the end with the engine in a module global (a script training at module level);
- exit: sys.exit(0);  raise: rank 1 raises after its first step (rank 0 then loses its peer);
- kill: rank 1 kills itself (SIGKILL) after its first step;
- kill_in_save: both ranks save a checkpoint after the first step, and rank 1 kills itself (SIGKILL) right after
  recording its arrival at the save's first collective (every rank arrived at it).

Forking saves the ~2 s of `import torch` per process, so dozens of real process exits fit in a minute; the
ranks import torch._dynamo themselves (every optimizer does), after the group exists, as a script started by
`slipstream run` does. Both ranks share CPU 0 so the gloo worker that must let go of the last collective
competes with the main thread on its way out, which is when the exit abort (SIGABRT after a finished run)
happened. Prints one JSON line per run: {"run": i, "ending": ..., "codes": [rank0, rank1]} with -N for a death
by signal N.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
for _name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
    os.environ.pop(_name, None)

import gc

import torch  # after the environment above
import torch._dynamo  # every optimizer imports it: here once, not once per rank process

import slipstream
import slipstream.comm

gc.freeze()  # what the driver imported is never collected: the ranks' exits do not walk it

CONFIG = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 2}, "collective_timeout": 20}
WORLD = None
KEPT: list[object] = []  # the engine of the `keep` ending: it lives until the interpreter finalizes
HANG_S = 60.0  # a run whose ranks have not ended by then is reported as hung (a rank waits on its peer)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def starve_gloo_workers() -> None:
    """Give gloo's worker threads the lowest priority (a loaded machine, made reliable): a worker then gets
    the CPU only while the main thread waits, so after the last collective the main thread reaches
    interpreter exit before the worker has let go of that collective's tensors -- the race behind the exit abort."""
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as handle:
                if handle.read().strip().startswith("pt_gloo"):
                    os.setpriority(os.PRIO_PROCESS, int(task), 19)
        except OSError:
            continue


def mean_over_ranks(loss: torch.Tensor) -> float:
    """The common metrics idiom: a temporary tensor through a collective, gone as soon as this returns."""
    total = loss.detach().reshape(1).clone()
    slipstream.comm.all_reduce(total)
    return float(total[0]) / 2


def kill_on_arrival(where: str) -> None:
    """SIGKILL this process once it has recorded its arrival at a collective issued from `where`."""
    from slipstream.comm import arrivals

    record = arrivals.record

    def recorded(identity: str) -> int:
        seq = record(identity)
        if where in identity:
            os.kill(os.getpid(), signal.SIGKILL)
        return seq

    arrivals.record = recorded  # type: ignore[assignment]


def rank_main(rank: int, port: int, ending: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      LOCAL_RANK=str(rank))
    if hasattr(os, "sched_setaffinity"):  # one core per rank: its gloo workers share it with its main thread
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})
    engine, *_ = slipstream.initialize(model=torch.nn.Linear(4, 4), config=CONFIG)
    global WORLD
    WORLD = torch.distributed.group.WORLD  # a script that keeps its group: it outlives destroy_process_group
    starve_gloo_workers()
    if ending == "keep":
        KEPT.append(engine)
    for step in range(2):
        loss = engine(torch.ones(2, 4)).sum()
        engine.backward(loss)
        engine.step()
        if ending == "raise" and rank == 1 and step == 0:
            raise RuntimeError("rank 1 fails on purpose")
        if ending == "kill" and rank == 1 and step == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        if ending == "kill_in_save" and step == 0:
            if rank == 1:
                kill_on_arrival("slipstream/checkpoint/")
            engine.save_checkpoint(os.path.join(tempfile.gettempdir(), f"slipstream-exit-job-{port}"), tag="both")
    print(f"rank {rank}: mean loss {mean_over_ranks(loss):.3f}", flush=True)
    if ending == "destroy":
        torch.distributed.destroy_process_group()
    if ending == "exit":
        sys.exit(0)


def _status(code: int) -> int:
    return -os.WTERMSIG(code) if os.WIFSIGNALED(code) else os.WEXITSTATUS(code)


def _reap(pids: list[int]) -> list[int | None]:
    codes: list[int | None] = [None] * len(pids)
    deadline = time.monotonic() + HANG_S
    while any(code is None for code in codes) and time.monotonic() < deadline:
        for index, pid in enumerate(pids):
            if codes[index] is None:
                done, code = os.waitpid(pid, os.WNOHANG)
                codes[index] = _status(code) if done else None
        time.sleep(0.02)
    for index, pid in enumerate(pids):
        if codes[index] is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    return codes


def drive(runs: int, endings: list[str]) -> bool:
    """True in a rank process (it then ends as the interpreter does), False in the driver when done."""
    for run in range(runs):
        ending, port, started = endings[run % len(endings)], free_port(), time.monotonic()
        pids = []
        for rank in range(2):
            pid = os.fork()
            if pid == 0:
                rank_main(rank, port, ending)
                return True
            pids.append(pid)
        codes = _reap(pids)
        shutil.rmtree(os.path.join(tempfile.gettempdir(), f"slipstream-exit-job-{port}"), ignore_errors=True)
        print(json.dumps({"run": run, "ending": ending, "codes": codes,
                          "seconds": round(time.monotonic() - started, 1)}), flush=True)
    return False


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--endings", default="return,destroy,exit")
    options = parser.parse_args()
    if drive(options.runs, options.endings.split(",")):
        sys.stdout.flush()  # a rank process: end here, through the interpreter's normal exit

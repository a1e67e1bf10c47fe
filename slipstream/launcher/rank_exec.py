"""The first moments of every rank process: finish its environment, bind its cores, then exec the user's command.

Owns what happens between the elastic agent starting a worker and the user's program running. The agent
runs `python -u <this file> [options] -- COMMAND...` for each local rank (by path, so it imports nothing
but the standard library); this file then

1. sends stderr into stdout when `--merge_stderr` is given, so each rank has one log file in output order
   (the agent has already pointed stdout at the rank's log file and tees it to the console);
2. adds DeepSpeed's variables the agent does not set: `LOCAL_SIZE` (= `LOCAL_WORLD_SIZE`), `CROSS_RANK`
   (= `GROUP_RANK`, the node rank) and `CROSS_SIZE` (= `GROUP_WORLD_SIZE`, the node count), and
   `--visible_devices` into each `--visible_env` name (e.g. `CUDA_VISIBLE_DEVICES`); and
   `SLIPSTREAM_PREFIXED_OUTPUT=1`: the launcher prefixes every line of this rank's output with `[rank<R>]:`, so
   init_distributed drops the prefix torch's excepthook would add to traceback lines a second time;
3. with `--bind_cores` (and optionally `--core_list 0-3,8`) gives this rank an equal, disjoint share of
   the cores with `os.sched_setaffinity` and sets `OMP_NUM_THREADS` to its size;
4. appends `--local_rank=N` right after the script (DeepSpeed's order) unless `--no_local_rank`, and
   replaces itself with the command via `os.execvp`, so the agent's signals reach the user's process.
"""

from __future__ import annotations

import argparse
import os
import sys

PREFIXED_OUTPUT = "SLIPSTREAM_PREFIXED_OUTPUT"


def parse_core_list(text: str) -> list[int]:
    """`1,3-5,7` -> [1, 3, 4, 5, 7] (DeepSpeed's `--bind_core_list` syntax): numbers or inclusive `LOW-HIGH`
    ranges, in ascending order and not overlapping (so no core is handed to two ranks); ValueError otherwise."""
    cores: list[int] = []
    for part in text.split(","):
        low, dash, high = part.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(f"--bind_core_list {text!r}: bad item {part!r}; use e.g. '0-3,8,10-11'")
        first, last = int(low), int(high) if dash else int(low)
        if last < first:
            raise ValueError(f"--bind_core_list {text!r}: range {part!r} ends before it starts; write '{last}-{first}'")
        if cores and first <= cores[-1]:
            raise ValueError(
                f"--bind_core_list {text!r}: {part!r} overlaps or comes before core {cores[-1]}; list the cores "
                f"in ascending order, each once, e.g. '0-3,8,10-11'"
            )
        cores.extend(range(first, last + 1))
    return cores


def cores_for_rank(cores: list[int], *, local_rank: int, local_size: int) -> list[int]:
    """This rank's equal share of `cores` (the remainder stays unused, as in DeepSpeed)."""
    per_rank = len(cores) // local_size
    if per_rank == 0:
        raise ValueError(
            f"--bind_cores_to_rank: {len(cores)} core(s) {cores} cannot be shared by {local_size} local ranks; "
            f"give more cores with --bind_core_list or run fewer ranks per node"
        )
    return cores[local_rank * per_rank : (local_rank + 1) * per_rank]


def build_command(command: list[str], *, local_rank: int, mode: str, no_local_rank: bool) -> list[str]:
    """The argv the rank execs: `python -u [-m] script --local_rank=N args` or the bare program."""
    target, *user_args = command
    extra = [] if no_local_rank else [f"--local_rank={local_rank}"]
    if mode == "binary":
        return [target, *extra, *user_args]
    python = [sys.executable, "-u", "-m"] if mode == "module" else [sys.executable, "-u"]
    return [*python, target, *extra, *user_args]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="rank_exec")
    parser.add_argument("--mode", choices=("script", "module", "binary"), default="script")
    parser.add_argument("--no_local_rank", action="store_true")
    parser.add_argument("--merge_stderr", action="store_true")
    parser.add_argument("--bind_cores", action="store_true")
    parser.add_argument("--core_list", default="")
    parser.add_argument("--visible_devices", default="")
    parser.add_argument("--visible_env", action="append", default=[])
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command after '--'")
    if args.merge_stderr:
        os.dup2(sys.stdout.fileno(), sys.stderr.fileno())
    env = os.environ
    local_rank, local_size = int(env["LOCAL_RANK"]), int(env["LOCAL_WORLD_SIZE"])
    env["LOCAL_SIZE"] = str(local_size)
    env["CROSS_RANK"] = env.get("GROUP_RANK", "0")
    env["CROSS_SIZE"] = env.get("GROUP_WORLD_SIZE", "1")
    env[PREFIXED_OUTPUT] = "1"
    for name in args.visible_env:
        if args.visible_devices:
            env[name] = args.visible_devices
    if args.bind_cores:
        available = (
            parse_core_list(args.core_list)
            if args.core_list
            else sorted(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity")
            else list(range(os.cpu_count() or 1))
        )
        mine = cores_for_rank(available, local_rank=local_rank, local_size=local_size)
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, mine)
        else:
            print(
                "slipstream: --bind_cores_to_rank: this platform has no sched_setaffinity; only OMP_NUM_THREADS is set",
                file=sys.stderr,
            )
        env["OMP_NUM_THREADS"] = str(len(mine))
    final = build_command(command, local_rank=local_rank, mode=args.mode, no_local_rank=args.no_local_rank)
    sys.stdout.flush()
    try:
        os.execvp(final[0], final)
    except OSError as error:
        print(f"slipstream: rank {env.get('RANK')} cannot start {final[0]!r}: {error}", file=sys.stderr)
        sys.exit(127)


if __name__ == "__main__":
    main(sys.argv[1:])

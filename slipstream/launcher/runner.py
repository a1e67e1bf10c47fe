"""`slipstream run`: DeepSpeed's launcher flags -> a world -> one local launch, or one launch per node.

Owns the command line of `slipstream run [options] script.py [script args]` (DeepSpeed's `deepspeed`
flags and defaults, see docs/launcher.md) and the choice between

- single node (one host in the world and no `--force_multi`): local.run_node in this process;
- `--node_rank N` (or DeepSpeed's `--no_ssh`): only node N's launch, here (start it on each node yourself);
- multi node: the per-node launch on every host through `--launcher` (multinode.py has the argv shapes),
  then wait. When a node's launch exits non-zero, the runner names that host and exit code, stops the
  other nodes (closes their ssh lifelines, then SIGTERM, then SIGKILL) and exits with that code.

The default launcher is `ssh`, not DeepSpeed's `pdsh`: ssh is on every machine that can run a multi-node
job at all, one ssh per host lets the runner tell which host failed and stop the others, and its stdin
carries the environment and the lifeline. pdsh, Slurm, OpenMPI and Hydra's mpirun (`mpich`, `impi`,
`mvapich`) remain available with `--launcher`.

World: the hostfile (`-H`, default `/job/hostfile`; absent means this machine alone), filtered by
`-i/--include` or `-e/--exclude`, cut by `--num_nodes`/`--num_gpus`. On one node without a hostfile, a
set `CUDA_VISIBLE_DEVICES` (the accelerator's visible-devices variable) gives the slots: `0,2` runs two
ranks on devices 0 and 2. Without it, the slot count is `--num_gpus`, else the accelerator's device
count. `--master_addr` defaults to 127.0.0.1 on one node and to the first host of the world otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from slipstream.launcher import multinode
from slipstream.launcher.environment import DEFAULT_ENV_FILE_NAME, as_mapping, collect_exports, describe_exports
from slipstream.launcher.hostfile import (
    HostfileError,
    World,
    encode_world,
    filter_world,
    limit_world,
    read_hostfile,
    select_world,
    world_of,
)
from slipstream.launcher.plan import LaunchPlan, Program, RankOptions, Rendezvous, encode_plan

DEFAULT_HOSTFILE = "/job/hostfile"
DEEPSPEED_ENVIRONMENT_NAME = os.environ.get("DS_ENV_FILE", DEFAULT_ENV_FILE_NAME)
"""DeepSpeed's name for the env file the launcher reads (Accelerate appends to it before launching)."""
STOP_GRACE_S = 15.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """DeepSpeed's launcher flags (same names and defaults; `--launcher` defaults to ssh, see above)."""
    add = parser.add_argument
    add(
        "-H",
        "--hostfile",
        default=None,
        help=f"MPI-style hostfile `host slots=N` (default {DEFAULT_HOSTFILE}; absent means this machine only)",
    )
    add("-i", "--include", default="", help="only these hosts/slots: 'worker-0@worker-1:0,2'")
    add("-e", "--exclude", default="", help="all but these hosts/slots: 'worker-1:0'")
    add("--num_nodes", type=int, default=-1, help="use the first N hosts of the hostfile")
    add("--num_gpus", "--num_accelerators", dest="num_gpus", type=int, default=-1, help="ranks per node")
    add("--min_elastic_nodes", type=int, default=-1, help="elastic: fewest nodes to run with")
    add("--max_elastic_nodes", type=int, default=-1, help="elastic: most nodes to admit")
    add("--max_restarts", type=int, default=100, help="elastic: worker-group restarts before giving up")
    add("--master_port", type=int, default=29500, help="rendezvous TCP port on the master")
    add("--master_addr", default="", help="rendezvous address (default 127.0.0.1 / the first host)")
    add("--node_rank", type=int, default=-1, help="run only this node's launch, here (no ssh)")
    add("--no_ssh", action="store_true", help="with --node_rank: start each node's launch yourself")
    add("--launcher", type=str.lower, default="ssh", choices=multinode.LAUNCHERS, help="multi-node launcher")
    add("--launcher_args", default="", help="extra arguments for the launcher, split with shlex")
    add("--ssh_port", type=int, default=None, help="ssh port (same as --launcher_args '-p PORT')")
    add("--module", action="store_true", help="the script is a Python module (python -m)")
    add("--no_python", action="store_true", help="run the program directly, not through python")
    add("--no_local_rank", action="store_true", help="do not pass --local_rank=N to the script")
    add("--force_multi", action="store_true", help="use the multi-node path even for one host")
    add("--enable_each_rank_log", default=None, help="directory for per-rank logs (default: a temp dir)")
    add("--bind_cores_to_rank", action="store_true", help="bind each rank to its share of the cores")
    add("--bind_core_list", default="", help="cores to share out, e.g. '0-7,16-23' (implies binding)")
    add("--elastic_training", action="store_true", help="restart failed workers via c10d rendezvous")
    add(
        "--autotuning",
        default="",
        choices=["tune", "run"],
        help="tune the config in a few short trials, then (run) launch the best (through `slipstream run` only)",
    )
    add("user_script", help="the training script (module with --module, program with --no_python)")
    add("user_args", nargs=argparse.REMAINDER, help="arguments of the training script")


def _local_slots(
    args: argparse.Namespace, environ: Mapping[str, str], visible_envs: list[str], device_count: int
) -> World:
    """This machine's world: the visible-devices list if set (and no filter), else 0..N-1."""
    visible = next((environ[name] for name in visible_envs if environ.get(name, "").strip()), "")
    if visible:
        ids = [item.strip() for item in visible.split(",")]
        if not all(item.isdigit() for item in ids):
            raise HostfileError(f"{visible_envs[0]}={visible!r}: expected comma-separated device indices, e.g. 0,2")
        world: World = {"localhost": [int(item) for item in ids]}
        source = f"{visible_envs[0]}={visible}"
    else:
        count = args.num_gpus if args.num_gpus > 0 else device_count
        if count <= 0:
            raise HostfileError("no accelerators found on this machine; pass --num_gpus N to run N ranks")
        world, source = {"localhost": list(range(count))}, "this machine"
        _note_ignored_visible_devices(environ, visible_envs)
    world = filter_world(world, include=args.include, exclude=args.exclude, source=source)
    return limit_world(world, num_slots=args.num_gpus) if visible else world


def _busy_port_message(addr: str, port: int) -> str | None:
    """Why the rendezvous cannot listen on addr:port here (instead of a DistNetworkError traceback), or None."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the TCP store does: TIME_WAIT is fine
        try:
            probe.bind((addr, port))
        except OSError as error:
            return (
                f"--master_port {port} on {addr} cannot be used ({error.strerror or error}): another job may "
                "hold it; pass --master_port with a free port"
            )
    return None


_OTHER_VISIBLE_ENVS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


def _note_ignored_visible_devices(environ: Mapping[str, str], visible_envs: list[str]) -> None:
    """A visible-devices variable the accelerator does not read would be ignored without a word; say so."""
    for name in _OTHER_VISIBLE_ENVS:
        if name not in visible_envs and environ.get(name, "").strip():
            print(
                f"slipstream run: note: {name}={environ[name]} is ignored: the accelerator here does not use it "
                "(DS_ACCELERATOR / no such devices); --num_gpus N sets the ranks per node",
                file=sys.stderr,
            )


def resolve_world(
    args: argparse.Namespace, environ: Mapping[str, str], *, visible_envs: list[str], device_count: int
) -> tuple[World, bool]:
    """(world, from_hostfile). Errors name the flag, the value and the fix."""
    for flag, value in (("--num_gpus", args.num_gpus), ("--num_nodes", args.num_nodes)):
        if value == 0 or value < -1:
            raise HostfileError(
                f"{flag} {value}: expected a positive count, or leave {flag} out to use every slot (-1, the default)"
            )
    if (args.include or args.exclude) and (args.num_nodes > 0 or args.num_gpus > 0):
        raise HostfileError(
            "--include/--exclude cannot be combined with --num_nodes/--num_gpus; "
            "say which slots to use with one of them only"
        )
    path = args.hostfile or DEFAULT_HOSTFILE
    resources = read_hostfile(path)
    if resources is None:
        if args.hostfile:
            raise HostfileError(f"hostfile {path} does not exist; fix the path, or leave out -H to run locally")
        return _local_slots(args, environ, visible_envs, device_count), False
    world = filter_world(world_of(resources), include=args.include, exclude=args.exclude, source=f"hostfile {path}")
    return limit_world(world, num_nodes=args.num_nodes, num_slots=args.num_gpus), True


def build_plan(args: argparse.Namespace, world: World, *, multi: bool, visible_envs: list[str]) -> LaunchPlan:
    if args.module and args.no_python:
        raise ValueError("--module and --no_python exclude each other: a module needs python -m")
    mode = "module" if args.module else ("binary" if args.no_python else "script")
    master = args.master_addr or (next(iter(world)) if multi else "127.0.0.1")
    rendezvous = Rendezvous(
        master_addr=master,
        master_port=args.master_port,
        elastic=args.elastic_training,
        min_nodes=args.min_elastic_nodes,
        max_nodes=args.max_elastic_nodes,
        max_restarts=args.max_restarts if args.elastic_training else 0,
    )
    log_dir = str(Path(args.enable_each_rank_log).resolve()) if args.enable_each_rank_log else None
    return LaunchPlan(
        world=world,
        rendezvous=rendezvous,
        program=Program(command=[args.user_script, *args.user_args], mode=mode, no_local_rank=args.no_local_rank),
        ranks=RankOptions(
            log_dir=log_dir,
            bind_cores=args.bind_cores_to_rank or bool(args.bind_core_list),
            core_list=args.bind_core_list,
            visible_envs=visible_envs,
        ),
    )


def _accelerator_facts() -> tuple[list[str], int]:
    from slipstream.accelerator import get_accelerator

    accelerator = get_accelerator()
    return list(accelerator.visible_devices_envs()), int(accelerator.device_count())


def prepare(args: argparse.Namespace) -> tuple[LaunchPlan, bool]:
    """(the launch plan, whether it takes the multi-node path); a ValueError names the wrong flag and the fix."""
    visible_envs, device_count = _accelerator_facts()
    world, _ = resolve_world(args, os.environ, visible_envs=visible_envs, device_count=device_count)
    multi = args.force_multi or len(world) > 1
    return build_plan(args, world, multi=multi, visible_envs=visible_envs), multi


def run(args: argparse.Namespace, *, raise_errors: bool = False) -> int:
    """Entry of `slipstream run`; returns the exit status. A bad flag prints the error and returns 2, or
    raises its ValueError with `raise_errors` (DeepSpeed's `runner.main`)."""
    from slipstream.launcher.local import run_node

    if getattr(args, "autotuning", ""):
        refusal = ValueError(
            f"--autotuning {args.autotuning}: the tuner runs trials through this launcher, so it is started from "
            f"`slipstream run --autotuning {args.autotuning} ...` (or DeepSpeed's `deepspeed` script), not from "
            "python -m slipstream.launcher.runner"
        )
        if raise_errors:
            raise refusal
        print(f"slipstream run: error: {refusal}", file=sys.stderr)
        return 2
    try:
        plan, multi = prepare(args)
    except ValueError as error:
        if raise_errors:
            raise
        print(f"slipstream run: error: {error}", file=sys.stderr)
        return 2
    if args.node_rank >= 0 or args.no_ssh:
        if args.node_rank < 0:
            print("slipstream run: error: --no_ssh needs --node_rank N (this node's index)", file=sys.stderr)
            return 2
        return run_node(plan, node_rank=args.node_rank)
    if not multi:
        busy = _busy_port_message(plan.rendezvous.master_addr, plan.rendezvous.master_port)
        if busy:
            print(f"slipstream run: error: {busy}", file=sys.stderr)
            return 2
        return run_node(plan, node_rank=0)
    launcher_args = args.launcher_args + (f" -p {args.ssh_port}" if args.ssh_port else "")
    return run_multinode(plan, launcher=args.launcher, launcher_args=launcher_args)


def launch_commands(
    plan: LaunchPlan, *, launcher: str, launcher_args: str, exports: dict[str, str], cwd: str
) -> list[tuple[str, list[str]]]:
    """(label, argv) per process the runner starts: one per host for ssh, one in all otherwise."""
    token, hosts = encode_plan(plan), list(plan.world)
    if launcher == "ssh":
        return [
            (
                host,
                multinode.ssh_argv(
                    host,
                    launcher_args=launcher_args,
                    command=multinode.remote_command(
                        multinode.node_argv(token, node_rank=str(rank), env_from_stdin=True), cwd=cwd
                    ),
                ),
            )
            for rank, host in enumerate(hosts)
        ]
    if launcher == "pdsh":
        command = multinode.remote_command(multinode.node_argv(token, node_rank="%n"), cwd=cwd, env=exports)
        return [("pdsh", multinode.pdsh_argv(hosts, command=command, launcher_args=launcher_args))]
    argv = multinode.node_argv(token, node_rank="-1")
    if launcher == "slurm":
        return [("srun", multinode.srun_argv(hosts, argv=argv, cwd=cwd, launcher_args=launcher_args))]
    if launcher in multinode.HYDRA_SETTINGS:
        hydra = multinode.hydra_argv(
            hosts,
            argv=argv,
            cwd=cwd,
            export_names=list(exports),
            settings=multinode.HYDRA_SETTINGS[launcher],
            launcher_args=launcher_args,
        )
        return [("mpirun", hydra)]
    return [
        (
            "mpirun",
            multinode.mpirun_argv(hosts, argv=argv, cwd=cwd, export_names=list(exports), launcher_args=launcher_args),
        )
    ]


def _stop(processes: dict[str, subprocess.Popen[bytes]], *, grace_s: float) -> None:
    """Close every lifeline, wait up to `grace_s`, then SIGTERM, then SIGKILL what is left."""
    for process in processes.values():
        if process.stdin is not None and not process.stdin.closed:
            process.stdin.close()
    for sig, wait_s in ((None, grace_s), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        alive = [p for p in processes.values() if p.poll() is None]
        if not alive:
            return
        for process in alive:
            if sig is not None:
                process.send_signal(sig)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and any(p.poll() is None for p in alive):
            time.sleep(0.1)


def run_multinode(plan: LaunchPlan, *, launcher: str, launcher_args: str) -> int:
    """Start every node's launch, wait; on the first failure name the host and stop the others."""
    exports = collect_exports(os.environ)
    print(describe_exports(exports), flush=True)
    mapping = as_mapping(exports)
    child_env = {**os.environ, **mapping, **({"PDSH_RCMD_TYPE": "ssh"} if launcher == "pdsh" else {})}
    commands = launch_commands(plan, launcher=launcher, launcher_args=launcher_args, exports=mapping, cwd=os.getcwd())
    print(
        f"slipstream: {plan.num_nodes} nodes x {plan.world_size} ranks in all via {launcher}: "
        f"{', '.join(f'{h}:{s}' for h, s in plan.world.items())}; master {plan.rendezvous.master_addr}:"
        f"{plan.rendezvous.master_port}",
        flush=True,
    )
    stop_signal: list[int] = []

    def handler(signum: int, _frame: object) -> None:
        stop_signal.append(signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    processes: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for label, argv in commands:
            stdin = subprocess.PIPE if launcher == "ssh" else subprocess.DEVNULL
            processes[label] = subprocess.Popen(argv, stdin=stdin, env=child_env)
            pipe = processes[label].stdin
            if launcher == "ssh" and pipe is not None:
                try:
                    pipe.write((json.dumps(mapping) + "\n").encode())
                    pipe.flush()
                except BrokenPipeError:
                    pass  # ssh already exited; the loop below reports its exit code
        while not stop_signal:
            codes = {label: p.poll() for label, p in processes.items()}
            failed = [(label, code) for label, code in codes.items() if code not in (None, 0)]
            if failed:
                label, code = failed[0]
                where = f"host {label}" if launcher == "ssh" else f"{label} (see the node report above)"
                print(
                    f"slipstream: {where} exited with code {code}; stopping the other nodes",
                    file=sys.stderr,
                    flush=True,
                )
                _stop(processes, grace_s=STOP_GRACE_S)
                return int(code) if code and code > 0 else 1
            if all(code == 0 for code in codes.values()):
                return 0
            time.sleep(0.2)
        print(
            f"slipstream: got {signal.Signals(stop_signal[0]).name}; stopping every node", file=sys.stderr, flush=True
        )
        _stop(processes, grace_s=5.0)
        return 128 + stop_signal[0]
    finally:
        _stop(processes, grace_s=0.0)
        for sig, old in previous.items():
            signal.signal(sig, old)


def parse_args(args: list[str] | None = None) -> argparse.Namespace:
    """DeepSpeed's `runner.parse_args`: the launcher's flags parsed from `args` (default: sys.argv[1:])."""
    parser = argparse.ArgumentParser(
        prog="python -m slipstream.launcher.runner", description="launch a training script (slipstream run)"
    )
    add_arguments(parser)
    return parser.parse_args(args)


def main(args: list[str] | None = None) -> int:
    """`python -m slipstream.launcher.runner [launcher flags] script.py [args]` (DeepSpeed's
    `python -m deepspeed.launcher.runner`): parse DeepSpeed's launcher flags and launch. As DeepSpeed's
    `runner.main`, a flag combination that cannot work raises ValueError (`--num_nodes 1 -i host`)."""
    return run(parse_args(args), raise_errors=True)


def parse_resource_filter(
    host_info: Mapping[str, list[int]], include_str: str = "", exclude_str: str = ""
) -> dict[str, list[int]]:
    """DeepSpeed's name for `hostfile.select_world`: host -> slots filtered by an include or exclude spec
    (`worker-0@worker-1:0,2`), in `host_info` order; ValueError for an unknown host or slot, or both given.
    Excluding everything gives `{}` (the launcher itself refuses an empty world)."""
    return select_world(dict(host_info), include=include_str, exclude=exclude_str, source="the host list")


def encode_world_info(world_info: Mapping[str, list[int] | int]) -> str:
    """DeepSpeed's name for `hostfile.encode_world`: host -> slots (or a slot count, meaning slots 0..N-1)
    as the argv-safe base64 JSON token (`--world_info`)."""
    world = {
        host: list(range(slots)) if isinstance(slots, int) else [int(slot) for slot in slots]
        for host, slots in world_info.items()
    }
    return encode_world(world)


if __name__ == "__main__":
    sys.exit(run(parse_args()))

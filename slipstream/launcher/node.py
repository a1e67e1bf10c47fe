"""Per-node entry point that the multi-node runner starts on every host.

    python -u -m slipstream.launcher.node --plan PLAN_B64 --node_rank N [--env_from_stdin]

Owns what a node does before its ranks start: read the exported environment (one JSON object on the
first line of stdin with `--env_from_stdin`, the ssh path), keep watching stdin as a lifeline (EOF means
the runner stopped the job or died: SIGTERM ourselves, which the elastic agent turns into stopping every
rank), find this node's rank (`--node_rank -1`: by host name in the world, else `SLURM_NODEID`,
`OMPI_COMM_WORLD_RANK`, `PMI_RANK`), then hand over to local.run_node. The exit status is the node's:
0, the failed rank's exit code, or 128 + signal.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading
from collections.abc import Mapping

from slipstream.launcher.hostfile import World
from slipstream.launcher.plan import decode_plan

_RANK_VARIABLES = ("SLURM_NODEID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def resolve_node_rank(world: World, requested: int, *, environ: Mapping[str, str], hostname: str) -> int:
    """`requested` if >= 0; else the index of this host's name in the world; else a scheduler's rank."""
    if requested >= 0:
        return requested
    hosts = list(world)
    for name in (hostname, hostname.split(".")[0]):
        if name in hosts:
            return hosts.index(name)
    for variable in _RANK_VARIABLES:
        if variable in environ:
            return int(environ[variable])
    raise ValueError(
        f"--node_rank -1: host {hostname!r} is not in the world {hosts} and none of {list(_RANK_VARIABLES)} "
        f"is set; pass --node_rank N"
    )


def _read_line(fd: int) -> bytes:
    """One line from `fd`, read byte by byte so nothing after it is buffered away from the lifeline."""
    data = bytearray()
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 1)
        if not chunk:
            break
        data += chunk
    return bytes(data)


def _watch_lifeline() -> None:
    """Block until stdin reaches EOF, then ask this process to stop (SIGTERM -> agent stops the ranks)."""
    # os.read, not sys.stdin: a daemon thread blocked inside the buffered reader holds its lock, and the
    # interpreter aborts at exit ("could not acquire lock for <stdin>").
    while os.read(0, 4096):
        pass
    print(
        f"slipstream: host {socket.gethostname()}: the launcher went away; stopping this node",
        file=sys.stderr,
        flush=True,
    )
    os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m slipstream.launcher.node", description=__doc__.splitlines()[0])
    parser.add_argument("--plan", required=True, help="base64 JSON launch plan (plan.encode_plan)")
    parser.add_argument("--node_rank", type=int, default=-1, help="this node's index in the world; -1: find it")
    parser.add_argument("--env_from_stdin", action="store_true", help="read exports as JSON from stdin's first line")
    args = parser.parse_args(argv)
    plan = decode_plan(args.plan)
    if args.env_from_stdin:
        line = _read_line(0)
        exports = json.loads(line.decode()) if line.strip() else {}
        os.environ.update({str(name): str(value) for name, value in exports.items()})
        threading.Thread(target=_watch_lifeline, name="slipstream-lifeline", daemon=True).start()
    node_rank = resolve_node_rank(plan.world, args.node_rank, environ=os.environ, hostname=socket.gethostname())
    from slipstream.launcher.local import run_node

    return run_node(plan, node_rank=node_rank)


if __name__ == "__main__":
    sys.exit(main())

"""What one job launch is, as small frozen records that travel to every node as base64 JSON.

Owns the launch description shared by the top-level runner (runner.py), which builds it from the
command line, and the per-node launcher (node.py -> local.py), which starts that node's ranks from it.
`encode_plan`/`decode_plan` turn it into a single argv-safe token (`--plan`), so no field is ever
re-parsed by a shell.
"""

from __future__ import annotations

import base64
import json
from dataclasses import asdict, dataclass, field

from slipstream.launcher.hostfile import World


@dataclass(frozen=True, kw_only=True, slots=True)
class Rendezvous:
    """Where the nodes meet and how failures are treated.

    Without elasticity the agent uses torch's `static` rendezvous (node rank given, no restarts); with
    `elastic=True` it uses `c10d` at the same address with `min_nodes..max_nodes` and `max_restarts`.
    """

    master_addr: str
    master_port: int = 29500
    elastic: bool = False
    min_nodes: int = -1
    max_nodes: int = -1
    max_restarts: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class Program:
    """The user's program: `command[0]` is a script path, a module name (`mode="module"`) or an executable
    (`mode="binary"`, DeepSpeed's `--no_python`); the rest are its arguments."""

    command: list[str]
    mode: str = "script"
    no_local_rank: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class RankOptions:
    """Per-rank process options: log directory (None: a temp dir), core binding, visible-device variables."""

    log_dir: str | None = None
    bind_cores: bool = False
    core_list: str = ""
    visible_envs: list[str] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchPlan:
    """The whole job: the world (host -> slots, rank order), rendezvous, program and rank options."""

    world: World
    rendezvous: Rendezvous
    program: Program
    ranks: RankOptions = field(default_factory=RankOptions)

    @property
    def num_nodes(self) -> int:
        return len(self.world)

    @property
    def world_size(self) -> int:
        return sum(len(slots) for slots in self.world.values())


def encode_plan(plan: LaunchPlan) -> str:
    """The plan as URL-safe base64 JSON: one argv item with no characters a shell would interpret."""
    return base64.urlsafe_b64encode(json.dumps(asdict(plan)).encode()).decode()


def decode_plan(text: str) -> LaunchPlan:
    """Inverse of `encode_plan`."""
    raw = json.loads(base64.urlsafe_b64decode(text.encode()).decode())
    return LaunchPlan(
        world={str(host): [int(slot) for slot in slots] for host, slots in raw["world"].items()},
        rendezvous=Rendezvous(**raw["rendezvous"]),
        program=Program(**raw["program"]),
        ranks=RankOptions(**raw["ranks"]),
    )

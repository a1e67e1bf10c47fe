"""Hostfiles and `--include`/`--exclude`: which hosts take part in a job and which slots each one gives.

Owns the parsing of DeepSpeed's MPI-style hostfile and of its node filters, and the resulting *world*:
an ordered mapping host -> list of slot ids (accelerator indices), in hostfile order. Global ranks are
assigned host-major in that order (host 0's slots first), as DeepSpeed does.

Hostfile syntax (one host per line; `#` starts a comment; blank lines are ignored)::

    worker-0 slots=4
    worker-1 slots=4   # a trailing comment is fine

Filter syntax (`-i/--include`, `-e/--exclude`): `NODE_SPEC[@NODE_SPEC ...]` with
`NODE_SPEC = NAME[:SLOT[,SLOT ...]]`, e.g. `-i "worker-0@worker-1:0,2"` or `-e "worker-1:0"`. A name
without slots means every slot of that host; a host named twice gets the union (as in DeepSpeed). Every error names the file (or flag), the line or spec,
the offending value and what to write instead.
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

World = dict[str, list[int]]
"""Ordered host -> slot ids taking part in the job (insertion order is rank order)."""

_HOST_LINE = re.compile(r"^(?P<host>\S+)(?:\s+(?P<rest>.*))?$")
_SLOTS = re.compile(r"^slots=(?P<value>\S*)$")


class HostfileError(ValueError):
    """A hostfile or an `--include`/`--exclude` value that cannot be used; the message says why."""


def parse_hostfile_text(text: str, *, source: str) -> dict[str, int]:
    """Parse hostfile `text` into host -> slot count, in file order. `source` names it in errors."""
    resources: dict[str, int] = {}
    first_line: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _HOST_LINE.match(line)
        rest = (match.group("rest") or "").strip() if match else ""
        slots_match = _SLOTS.match(rest)
        where = f"{source}, line {number}"
        if match is None or slots_match is None:
            raise HostfileError(
                f"{where}: cannot read {raw.strip()!r}; each line must be `HOSTNAME slots=N` "
                f"(e.g. `worker-0 slots=8`), a `#` comment, or blank"
            )
        host, value = match.group("host"), slots_match.group("value")
        if not value.isdigit() or int(value) <= 0:
            raise HostfileError(
                f"{where}: bad slots={value!r} for host {host!r}; slots must be a positive integer "
                f"(the number of accelerators on that host), e.g. `{host} slots=8`"
            )
        if host in resources:
            raise HostfileError(
                f"{where}: duplicate host {host!r} (first listed on line {first_line[host]}); "
                f"list each host once with its total slot count"
            )
        resources[host] = int(value)
        first_line[host] = number
    if not resources:
        raise HostfileError(f"{source}: no hosts found; add lines such as `worker-0 slots=8`")
    return resources


def read_hostfile(path: str | Path) -> dict[str, int] | None:
    """The hostfile at `path` as host -> slot count, or None when no file is there (local mode)."""
    path = Path(path)
    if not path.is_file():
        return None
    return parse_hostfile_text(path.read_text(), source=f"hostfile {path}")


def parse_node_spec(spec: str, *, flag: str) -> dict[str, list[int]]:
    """`NAME[:SLOT,...]@NAME...` -> host -> slot ids (an empty list means all of that host's slots)."""
    parsed: dict[str, list[int]] = {}
    for part in spec.split("@"):
        part = part.strip()
        name, _, slot_text = part.partition(":")
        if not name:
            raise HostfileError(
                f"{flag} {spec!r}: empty host name in {part!r}; write NAME[:SLOT[,SLOT...]] joined by '@', "
                f"e.g. 'worker-0@worker-1:0,2'"
            )
        slots: list[int] = []
        if ":" in part:
            for item in slot_text.split(","):
                if not item.strip().isdigit():
                    raise HostfileError(
                        f"{flag} {spec!r}: bad slot {item!r} for host {name!r}; slots are non-negative "
                        f"integers separated by commas, e.g. '{name}:0,2'"
                    )
                slots.append(int(item))
        if name in parsed:  # named again (DeepSpeed merges): the union; a bare name already means every slot
            parsed[name] = [] if not parsed[name] or not slots else sorted({*parsed[name], *slots})
        else:
            parsed[name] = slots
    return parsed


def _check_known(filters: dict[str, list[int]], world: World, *, flag: str, source: str) -> None:
    for host, slots in filters.items():
        if host not in world:
            raise HostfileError(f"{flag}: unknown host {host!r}; {source} lists {list(world)}")
        unknown = [slot for slot in slots if slot not in world[host]]
        if unknown:
            raise HostfileError(f"{flag}: no slot {unknown[0]} on host {host!r}; {source} gives it slots {world[host]}")


def world_of(resources: dict[str, int]) -> World:
    """host -> slot count as host -> slot ids 0..count-1."""
    return {host: list(range(count)) for host, count in resources.items()}


def select_world(world: World, *, include: str = "", exclude: str = "", source: str = "the hostfile") -> World:
    """Apply `--include` or `--exclude` (not both) to `world` and return what is left, in world order.

    Hosts left with no slot are dropped; the result may be empty (DeepSpeed's `parse_resource_filter`).
    """
    available = world
    if include and exclude:
        raise HostfileError(f"--include {include!r} and --exclude {exclude!r} were both given; use one of them")
    if include:
        wanted = parse_node_spec(include, flag=f"--include {include!r}")
        _check_known(wanted, available, flag=f"--include {include!r}", source=source)
        world = {
            host: sorted(set(wanted[host])) if wanted[host] else slots
            for host, slots in world.items()
            if host in wanted
        }
    elif exclude:
        unwanted = parse_node_spec(exclude, flag=f"--exclude {exclude!r}")
        _check_known(unwanted, available, flag=f"--exclude {exclude!r}", source=source)
        world = {
            host: [slot for slot in slots if unwanted.get(host) and slot not in unwanted[host]]
            if host in unwanted
            else slots
            for host, slots in world.items()
        }
    return {host: slots for host, slots in world.items() if slots}


def filter_world(world: World, *, include: str = "", exclude: str = "", source: str = "the hostfile") -> World:
    """`select_world`, where an empty result is an error (a launch needs at least one slot)."""
    available = world
    world = select_world(world, include=include, exclude=exclude, source=source)
    if not world:
        raise HostfileError(
            f"no slots left after --include {include!r} / --exclude {exclude!r} over {source} "
            f"({available}); keep at least one host and slot"
        )
    return world


def limit_world(world: World, *, num_nodes: int = -1, num_slots: int = -1) -> World:
    """DeepSpeed's `--num_nodes N` (first N hosts) and `--num_gpus N` (first N slots of each host)."""
    if num_nodes > 0:
        if num_nodes > len(world):
            raise HostfileError(
                f"--num_nodes {num_nodes} asks for more hosts than the {len(world)} available "
                f"({list(world)}); lower --num_nodes or add hosts to the hostfile"
            )
        world = dict(list(world.items())[:num_nodes])
    if num_slots > 0:
        short = {host: len(slots) for host, slots in world.items() if len(slots) < num_slots}
        if short:
            raise HostfileError(
                f"--num_gpus {num_slots} asks for more slots than these hosts have: {short}; "
                f"lower --num_gpus or raise slots= in the hostfile"
            )
        world = {host: slots[:num_slots] for host, slots in world.items()}
    return world


def encode_world(world: World) -> str:
    """The world as URL-safe base64 JSON (DeepSpeed's `--world_info`), safe to put in any argv."""
    return base64.urlsafe_b64encode(json.dumps(world).encode()).decode()


def decode_world(text: str) -> World:
    """Inverse of `encode_world`."""
    raw = json.loads(base64.urlsafe_b64decode(text.encode()).decode())
    return {str(host): [int(slot) for slot in slots] for host, slots in raw.items()}

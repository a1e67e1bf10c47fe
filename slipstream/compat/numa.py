"""DeepSpeed's `deepspeed.utils.numa`: core-list parsing and `numactl` command lines for core binding.

Slipstream's launcher binds a rank's cores itself (`--bind_cores_to_rank`: launcher/rank_exec.py gives each
local rank an equal, disjoint share with `sched_setaffinity`), so it never runs `numactl`. These are the
names DeepSpeed client code calls to build its own command lines:

- `parse_range_list("0,2-4,6")` -> [0, 2, 3, 4, 6]: the launcher's `--bind_core_list` syntax (ascending,
  non-overlapping items; ValueError otherwise); `parse_range("2-4")` -> range(2, 5) for one item;
- `get_numa_cores()`: the cores of each NUMA node, read from Linux's sysfs (`[]` where it is absent);
  a node without cores (high-bandwidth memory in flat mode) is `[]`;
- `get_numactl_cmd(bind_core_list, num_local_procs, local_rank)` -> (cores per rank,
  `["numactl", ("-m" NODES | "-p" HBM_NODE), "-C", "CORES"]`): the same share of the cores the launcher
  gives that rank, with memory bound to the NUMA node(s) holding all of them (their high-bandwidth memory
  node in flat mode, where each core node has one such node).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

from slipstream.launcher.rank_exec import cores_for_rank, parse_core_list

__all__ = ["check_for_numactl_pkg", "get_numa_cores", "get_numactl_cmd", "parse_range", "parse_range_list"]

NODE_ROOT = Path("/sys/devices/system/node")
"""Where Linux lists the NUMA nodes (`node<N>/cpulist`)."""


def parse_range(rng: str) -> range:
    """One item of a core list: `"3"` -> range(3, 4), `"2-4"` -> range(2, 5); ValueError for anything else."""
    if "," in rng:
        raise ValueError(f"core range {rng!r}: one item only (a number or LOW-HIGH); use parse_range_list for lists")
    cores = parse_core_list(rng)
    return range(cores[0], cores[-1] + 1)


def parse_range_list(range_str: str) -> list[int]:
    """`"0,2-4,6"` -> [0, 2, 3, 4, 6]; items ascending and not overlapping, else ValueError."""
    return parse_core_list(range_str)


def get_numa_cores(root: Path = NODE_ROOT) -> list[list[int]]:
    """The cores of NUMA node 0, 1, ... (`[]` for a node without cores); `[]` when the system lists none."""
    nodes: dict[int, list[int]] = {}
    for path in root.glob("node[0-9]*") if root.is_dir() else []:
        match = re.fullmatch(r"node(\d+)", path.name)
        cpulist = path / "cpulist"
        if match and cpulist.is_file():
            text = cpulist.read_text().strip()
            nodes[int(match.group(1))] = parse_core_list(text) if text else []
    return [nodes.get(index, []) for index in range(max(nodes) + 1)] if nodes else []


def check_for_numactl_pkg() -> bool:
    """Whether the `numactl` program is on PATH (and a note on stderr saying how to get it when not)."""
    if shutil.which("numactl") is not None:
        return True
    print("numactl is not on PATH; install the numactl package (apt, yum or pacman)", file=sys.stderr)
    return False


def _ranges(cores: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2,5,7-8" (the `numactl -C` form)."""
    items: list[str] = []
    start = previous = cores[0]
    for core in [*cores[1:], None]:
        if core is not None and core == previous + 1:
            previous = core
            continue
        items.append(str(start) if start == previous else f"{start}-{previous}")
        if core is not None:
            start = previous = core
    return ",".join(items)


def _available_cores() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def get_numactl_cmd(
    bind_core_list: str | None, num_local_procs: int, local_rank: int, *, numa_cores: list[list[int]] | None = None
) -> tuple[int, list[str]]:
    """(cores per rank, the `numactl` argv prefix) for local rank `local_rank` of `num_local_procs`.

    The cores are `bind_core_list` (None: the cores this process may run on), shared out as the launcher
    does; `numa_cores` defaults to `get_numa_cores()`. ValueError when the cores cannot be shared or when
    `KMP_AFFINITY` is set (it overrides numactl's binding)."""
    if "KMP_AFFINITY" in os.environ:
        raise ValueError(
            "KMP_AFFINITY is set: it overrides the core binding numactl sets up; unset it (`unset KMP_AFFINITY`) "
            "before launching"
        )
    cores = parse_core_list(bind_core_list) if bind_core_list else _available_cores()
    mine = cores_for_rank(cores, local_rank=local_rank, local_size=num_local_procs)
    nodes = get_numa_cores() if numa_cores is None else numa_cores
    holding = [index for index, node in enumerate(nodes) if node and set(mine) <= set(node)]
    command = ["numactl"]
    if holding:
        with_cores = [index for index, node in enumerate(nodes) if node]
        without = [index for index, node in enumerate(nodes) if not node]
        if without and len(without) == len(with_cores):  # flat high-bandwidth memory: one memory node per core node
            command += ["-p", str(without[with_cores.index(holding[0])])]
        else:  # one node, or several nodes listing the same cores (fake NUMA): bind memory to them all
            command += ["-m", ",".join(str(index) for index in holding)]
    return len(mine), [*command, "-C", _ranges(mine)]

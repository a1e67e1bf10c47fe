"""DeepSpeed's launcher-area names on Slipstream: `launcher.runner`'s parse_resource_filter /
encode_world_info / parse_args / main, `launcher.multinode_runner`'s backend classes, `utils.numa` and
`utils.pin_memory_tracker`. Command lines and parsed resources are compared with exact expected values."""

from __future__ import annotations

import logging
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest

from slipstream.compat import multinode_runner as mnr
from slipstream.compat import numa
from slipstream.launcher import runner
from slipstream.launcher.hostfile import decode_world
from slipstream.launcher.plan import LaunchPlan, decode_plan
from slipstream.utils import pin_memory_tracker as pmt

PY = sys.executable
HOSTS = {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}


# ---------------------------------------------------------------------------------------------- runner
@pytest.mark.parametrize(
    ("include", "exclude", "expected"),
    [
        ("", "", HOSTS),
        ("worker-1:0,3", "", {"worker-1": [0, 3]}),
        ("worker-1@worker-0:2", "", {"worker-0": [2], "worker-1": [0, 1, 2, 3]}),  # hostfile order
        ("worker-0:1@worker-0:0,1", "", {"worker-0": [0, 1]}),  # a host named twice: the union
        ("", "worker-1", {"worker-0": [0, 1, 2, 3]}),
        ("", "worker-0:0,1@worker-1:3", {"worker-0": [2, 3], "worker-1": [0, 1, 2]}),
        ("", "worker-0@worker-1", {}),  # excluding everything is an empty world, not an error here
    ],
)
def test_parse_resource_filter(include: str, exclude: str, expected: dict[str, list[int]]) -> None:
    result = runner.parse_resource_filter(HOSTS, include_str=include, exclude_str=exclude)
    assert result == expected
    assert list(result) == list(expected)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"include_str": "A", "exclude_str": "B"}, "were both given; use one of them"),
        ({"include_str": "jeff"}, "unknown host 'jeff'"),
        ({"exclude_str": "worker-1:4"}, "no slot 4 on host 'worker-1'"),
        ({"exclude_str": "worker-1@worker-0:1@5"}, "unknown host '5'"),
    ],
)
def test_parse_resource_filter_errors_are_value_errors(kwargs: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        runner.parse_resource_filter(HOSTS, **kwargs)


def test_encode_world_info_takes_slot_lists_or_counts() -> None:
    assert decode_world(runner.encode_world_info({"a": 2, "b": [1, 3]})) == {"a": [0, 1], "b": [1, 3]}


def test_main_raises_where_the_cli_prints(capsys: pytest.CaptureFixture[str]) -> None:
    argv = "--num_nodes 1 -i localhost foo.py".split()
    with pytest.raises(ValueError, match="--include/--exclude cannot be combined with --num_nodes/--num_gpus"):
        runner.main(argv)
    assert runner.run(runner.parse_args(argv)) == 2
    assert "slipstream run: error: --include/--exclude cannot be combined" in capsys.readouterr().err


def test_parse_args_defaults() -> None:
    args = runner.parse_args(["train.py", "--lr", "1"])
    assert (args.user_script, args.user_args) == ("train.py", ["--lr", "1"])
    assert (args.include, args.exclude, args.num_nodes, args.num_gpus) == ("", "", -1, -1)
    assert (args.master_addr, args.master_port, args.launcher_args) == ("", 29500, "")


# ---------------------------------------------------------------------------------------------- multinode_runner
def _args(*flags: str) -> Any:
    return runner.parse_args([*flags, "train.py", "--prompt", "I am 6' tall"])


def _plan(argv: list[str]) -> LaunchPlan:
    return decode_plan(argv[argv.index("--plan") + 1])


def _node_tail(argv: list[str], node_rank: str) -> list[str]:
    """The per-node launch at the end of `argv`, with the plan token replaced by PLAN."""
    start = argv.index(PY)
    tail = argv[start:]
    tail[tail.index("--plan") + 1] = "PLAN"
    assert tail == [PY, "-u", "-m", "slipstream.launcher.node", "--plan", "PLAN", "--node_rank", node_rank]
    return argv[:start]


def test_add_export_quotes_shell_special_values_and_the_command_carries_the_shell_value() -> None:
    runner_ = mnr.PDSHRunner(_args(), "WORLD")
    runner_.add_export(" SLURM_JOB_CPUS_PER_NODE ", " 64(x2) ")
    runner_.add_export("PYTHONPATH", "/usr/lib/python3/site-packages")
    assert runner_.exports == {
        "SLURM_JOB_CPUS_PER_NODE": '"64(x2)"',
        "PYTHONPATH": "/usr/lib/python3/site-packages",
    }
    runner_.add_export("ODD", 'say "hi')  # a double quote inside: kept as given, not re-read by a shell
    runner_.exports["DIRECT"] = "'a b'"  # a word set directly is read as a shell reads it
    assert runner_.export_values() == {
        "SLURM_JOB_CPUS_PER_NODE": "64(x2)",
        "PYTHONPATH": "/usr/lib/python3/site-packages",
        "ODD": 'say "hi',
        "DIRECT": "a b",
    }
    runner_.exports["BROKEN"] = '"open'
    with pytest.raises(ValueError, match="exports\\['BROKEN'\\] = '\"open' is not a shell word"):
        runner_.export_values()


def test_pdsh_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    runner_ = mnr.PDSHRunner(_args("--launcher_args", "-R ssh", "--ssh_port", "2222"), "WORLD")
    runner_.add_export("NCCL_X", "a;b")
    environment: dict[str, str] = {"PDSH_SSH_ARGS_APPEND": "-q"}
    cmd, kill, env = runner_.get_cmd(environment, HOSTS)
    assert env is environment and env == {"PDSH_RCMD_TYPE": "ssh", "PDSH_SSH_ARGS_APPEND": "-q -p 2222"}
    assert cmd[:-1] == ["pdsh", "-S", "-f", "1024", "-w", "worker-0,worker-1", "-R", "ssh"]
    remote = shlex.split(cmd[-1])
    assert remote[:6] == ["cd", str(tmp_path), "&&", "exec", "env", "NCCL_X=a;b"]
    _node_tail(remote[6:], "%n")
    plan = _plan(remote)
    assert plan.world == HOSTS and plan.rendezvous.master_addr == "worker-0"
    assert plan.program.command == ["train.py", "--prompt", "I am 6' tall"]  # one argv item, never re-split
    token = remote[remote.index("--plan") + 1]
    assert kill == [
        "pdsh",
        "-S",
        "-f",
        "1024",
        "-w",
        "worker-0,worker-1",
        f"pkill -f 'slipstream.launcher.node --plan {token}'",
    ]


@pytest.mark.parametrize(
    ("launcher_args", "nic"),
    [
        ("", ["--mca", "btl_tcp_if_include", "eth0"]),
        ("-mca btl_tcp_if_include eth1", []),
        ("--mca btl_tcp_if_include eth1", []),
    ],
)
def test_openmpi_command(launcher_args: str, nic: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    runner_ = mnr.OpenMPIRunner(_args("--launcher_args", launcher_args), "WORLD", {"worker-0": 4, "worker-1": 4})
    environment: dict[str, str] = {}
    cmd = runner_.get_cmd(environment, {"worker-0": 4, "worker-1": 4})
    head = _node_tail(cmd, "-1")
    assert head == [
        "mpirun",
        "-n",
        "2",
        "--host",
        "worker-0,worker-1",
        "--map-by",
        "ppr:1:node",
        "--wdir",
        str(tmp_path),
        "-x",
        "UCX_TLS",
        "--mca",
        "btl",
        "^openib",
        *nic,
        *shlex.split(launcher_args),
    ]
    assert environment == {"UCX_TLS": "tcp"}
    assert _plan(cmd).world == HOSTS  # slot counts become slot ids


@pytest.mark.parametrize(
    ("cls", "settings"),
    [
        (mnr.MPICHRunner, []),
        (mnr.IMPIRunner, ["-genv", "I_MPI_PIN", "0"]),
        (mnr.MVAPICHRunner, ["-genv", "MV2_ENABLE_AFFINITY", "0"]),
    ],
)
def test_hydra_commands(cls: type, settings: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    runner_ = cls(_args("-i", "worker-1:1,2"), "WORLD", {"worker-0": 4, "worker-1": 4})
    runner_.add_export("A", "value-of-a")
    environment: dict[str, str] = {}
    cmd = runner_.get_cmd(environment, {"worker-1": [1, 2]})
    head = _node_tail(cmd, "-1")
    names = ",".join(sorted(environment))
    assert head == [
        "mpirun",
        "-n",
        "1",
        "-ppn",
        "1",
        "-hosts",
        "worker-1",
        "-wdir",
        str(tmp_path),
        "-genvlist",
        names,
        *settings,
    ]
    assert environment["A"] == "value-of-a" and "value-of-a" not in cmd  # values travel in the environment
    assert ("MV2_SMP_USE_CMA" in environment) == (cls is mnr.MVAPICHRunner)
    assert _plan(cmd).world == {"worker-1": [1, 2]}  # include/exclude work on every backend
    assert runner_.name == {"MPICHRunner": "mpich", "IMPIRunner": "impi", "MVAPICHRunner": "mvapich"}[cls.__name__]


def test_slurm_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    args = _args("--launcher_args", "--partition gpu")
    args.slurm_comment = "my job"
    runner_ = mnr.SlurmRunner(args, "WORLD", {"worker-0": 4, "worker-1": 4})
    runner_.add_export("B", "x y")
    environment: dict[str, str] = {}
    cmd = runner_.get_cmd(environment, HOSTS)
    assert _node_tail(cmd, "-1") == [
        "srun",
        "--nodes",
        "2",
        "--ntasks",
        "2",
        "--ntasks-per-node",
        "1",
        "--nodelist",
        "worker-0,worker-1",
        "--kill-on-bad-exit=1",
        "--export=ALL",
        "--chdir",
        str(tmp_path),
        "--comment",
        "my job",
        "--partition",
        "gpu",
    ]
    assert environment == {"B": "x y"}  # the shell value of the quoted word, passed on by --export=ALL


@pytest.mark.parametrize(
    ("cls", "name", "program"),
    [
        (mnr.PDSHRunner, "pdsh", "pdsh"),
        (mnr.OpenMPIRunner, "openmpi", "ompi_info"),
        (mnr.MPICHRunner, "mpich", "mpirun"),
        (mnr.IMPIRunner, "impi", "mpirun"),
        (mnr.SlurmRunner, "slurm", "sinfo"),
    ],
)
def test_each_backend_is_named_and_found_by_its_program(
    cls: type[mnr.MultiNodeRunner], name: str, program: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool = {"worker-0": 4}
    runner_ = cls(_args(), "WORLD") if cls is mnr.PDSHRunner else cls(_args(), "WORLD", pool)  # type: ignore[call-arg]
    asked: list[str] = []
    monkeypatch.setattr(mnr.shutil, "which", lambda cmd: asked.append(cmd) or None)
    assert runner_.name == name and not runner_.backend_exists() and asked == [program]
    monkeypatch.setattr(mnr.shutil, "which", lambda cmd: f"/usr/bin/{cmd}")
    assert runner_.backend_exists()


def test_a_minimal_namespace_and_an_unsupported_flag() -> None:
    from types import SimpleNamespace

    class Dummy(mnr.MultiNodeRunner):
        def backend_exists(self) -> bool:
            return True

        def get_cmd(self, environment: Any, active_resources: Any) -> list[str]:
            return self.node_command(active_resources, node_rank="0")[1]

    dummy = Dummy(SimpleNamespace(user_args=["--x"], user_script="s.py"), "WORLD")
    assert dummy.name == "Dummy" and dummy.user_arguments == ["--x"]
    plan = _plan(dummy.get_cmd({}, {"h": 1}))  # every other flag takes the launcher's default
    assert plan.world == {"h": [0]} and plan.program.command == ["s.py", "--x"]
    with pytest.raises(NotImplementedError, match="--save_pid"):
        Dummy(SimpleNamespace(user_args=[], user_script="s.py", save_pid=True), "WORLD")


# ---------------------------------------------------------------------------------------------- numa
def test_parse_range_list_and_parse_range() -> None:
    assert numa.parse_range_list("0,2-4,6,8-9") == [0, 2, 3, 4, 6, 8, 9]
    assert numa.parse_range("2-4") == range(2, 5) and numa.parse_range("7") == range(7, 8)
    for bad in ("0,2-6,5-9", "8,2-6", "1,6-2", "a"):
        with pytest.raises(ValueError, match="--bind_core_list"):
            numa.parse_range_list(bad)
    with pytest.raises(ValueError, match="one item only"):
        numa.parse_range("1,2")


def test_get_numa_cores_reads_sysfs(tmp_path: Path) -> None:
    for node, cpus in (("node0", "0-3,8"), ("node1", "4-7"), ("node2", "")):
        (tmp_path / node).mkdir()
        (tmp_path / node / "cpulist").write_text(cpus + "\n")
    assert numa.get_numa_cores(tmp_path) == [[0, 1, 2, 3, 8], [4, 5, 6, 7], []]
    assert numa.get_numa_cores(tmp_path / "absent") == []


@pytest.mark.parametrize(
    ("nodes", "rank", "expected"),
    [
        ([[0, 1, 2, 3], [4, 5, 6, 7]], 1, ["numactl", "-m", "1", "-C", "4-7"]),
        ([[0, 1, 2, 3], [4, 5, 6, 7], [], []], 1, ["numactl", "-p", "3", "-C", "4-7"]),  # flat HBM
        ([[0, 1, 2, 3, 4, 5, 6, 7]] * 2, 0, ["numactl", "-m", "0,1", "-C", "0-3"]),  # fake NUMA
        ([[0, 1, 2, 3, 4, 5], [6, 7]], 1, ["numactl", "-C", "4-7"]),  # spans two nodes: no memory binding
        ([], 0, ["numactl", "-C", "0-3"]),
    ],
)
def test_get_numactl_cmd(
    nodes: list[list[int]], rank: int, expected: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KMP_AFFINITY", raising=False)
    assert numa.get_numactl_cmd("0-7", 2, rank, numa_cores=nodes) == (4, expected)


def test_get_numactl_cmd_core_gaps_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KMP_AFFINITY", raising=False)
    assert numa.get_numactl_cmd("0-2,5,7-9", 1, 0, numa_cores=[]) == (7, ["numactl", "-C", "0-2,5,7-9"])
    with pytest.raises(ValueError, match="cannot be shared by 4 local ranks"):
        numa.get_numactl_cmd("0-1", 4, 0, numa_cores=[])
    monkeypatch.setenv("KMP_AFFINITY", "compact")
    with pytest.raises(ValueError, match="unset it"):
        numa.get_numactl_cmd("0-7", 2, 0, numa_cores=[])


# ---------------------------------------------------------------------------------------------- pin_memory_tracker
def test_fmt_bytes() -> None:
    assert [pmt._fmt_bytes(n) for n in (512, 2048, 2**20, 3 * 2**29)] == ["512 B", "2.0 KB", "1.00 MB", "1.500 GB"]


def test_tracker_totals_and_milestones(caplog: pytest.LogCaptureFixture) -> None:
    gib = 2**30
    tracker = pmt._tracker
    tracker.reset()
    logger = logging.getLogger("slipstream")
    propagate, logger.propagate = logger.propagate, True
    try:
        with caplog.at_level(logging.INFO, logger="slipstream"):
            pmt.track_pinned_memory(30 * gib)
            assert (tracker._bytes, tracker._calls, tracker._next_checkpoint) == (30 * gib, 1, 32 * gib)
            pmt.track_pinned_memory(10 * gib)
            assert tracker._next_checkpoint == 64 * gib
            pmt.track_pinned_memory(100 * gib)  # crosses 64 and 128 GiB in one call
            assert tracker._next_checkpoint == 256 * gib
            pmt.pinned_memory_summary("after init")
        messages = [record.getMessage() for record in caplog.records if record.levelno == logging.INFO]
        assert messages == [
            "pinned-memory checkpoint: crossed 32.000 GB; 40.000 GB pinned in 2 allocations",
            "pinned-memory checkpoint: crossed 64.000 GB; 140.000 GB pinned in 3 allocations",
            "pinned-memory checkpoint: crossed 128.000 GB; 140.000 GB pinned in 3 allocations",
            "pinned memory after init: 140.000 GB in 3 allocations",
        ]
    finally:
        logger.propagate = propagate
        tracker.reset()
    assert (tracker._bytes, tracker._calls, tracker._next_checkpoint) == (0, 0, 32 * gib)


def test_cuda_pin_memory_is_tracked(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from slipstream.accelerator.cuda import CudaAccelerator

    pinned = torch.zeros(256)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: pinned if self is not pinned else self)
    accelerator = CudaAccelerator.__new__(CudaAccelerator)  # pin_memory needs no device state
    pmt._tracker.reset()
    try:
        assert accelerator.pin_memory(torch.zeros(256)) is pinned
        accelerator.pin_memory(pinned)  # already pinned: torch returns it, nothing new is counted
        assert (pmt._tracker._bytes, pmt._tracker._calls) == (1024, 1)
    finally:
        pmt._tracker.reset()

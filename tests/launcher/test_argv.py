"""Exact argv of ssh/pdsh/srun/mpirun built from a hostfile, the per-rank command, the world resolution rules."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import pytest

from slipstream.cli.run import is_short_form
from slipstream.launcher import multinode
from slipstream.launcher.hostfile import HostfileError
from slipstream.launcher.local import rank_exec_args
from slipstream.launcher.node import resolve_node_rank
from slipstream.launcher.plan import decode_plan
from slipstream.launcher.rank_exec import build_command, cores_for_rank, parse_core_list
from slipstream.launcher.runner import add_arguments, build_plan, launch_commands, resolve_world

PY = sys.executable
NODE = [PY, "-u", "-m", "slipstream.launcher.node", "--plan"]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


@pytest.fixture()
def hostfile(tmp_path: Path) -> Path:
    path = tmp_path / "hostfile"
    path.write_text("127.0.0.2 slots=1\n127.0.0.3 slots=1\n")
    return path


def plan_for(hostfile: Path, *extra: str):  # type: ignore[no-untyped-def]
    args = parse(["-H", str(hostfile), *extra, "train.py", "--deepspeed_config", "ds.json"])
    world, _ = resolve_world(args, {}, visible_envs=[], device_count=1)
    return build_plan(args, world, multi=True, visible_envs=[])


def test_ssh_argv_per_host(hostfile: Path) -> None:
    plan = plan_for(hostfile, "--master_addr", "127.0.0.2")
    args = "-p 2222 -i /k/key -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null"
    commands = launch_commands(plan, launcher="ssh", launcher_args=args, exports={"A": "x y"}, cwd="/work dir")
    assert [label for label, _ in commands] == ["127.0.0.2", "127.0.0.3"]
    for rank, (host, argv) in enumerate(commands):
        assert argv[:-1] == [
            "ssh",
            "-p",
            "2222",
            "-i",
            "/k/key",
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
            "-o",
            "BatchMode=yes",
            host,
        ]
        remote = shlex.split(argv[-1])
        assert remote[:5] == ["cd", "/work dir", "&&", "exec", PY]
        assert remote[4:9] == NODE
        assert remote[10:] == ["--node_rank", str(rank), "--env_from_stdin"]
        assert "x y" not in argv[-1]  # values travel on stdin, never in the command
        assert decode_plan(remote[9]) == plan
    assert plan.rendezvous.master_addr == "127.0.0.2" and plan.world == {"127.0.0.2": [0], "127.0.0.3": [0]}


def test_pdsh_argv_carries_env_items(hostfile: Path) -> None:
    plan = plan_for(hostfile)
    [(label, argv)] = launch_commands(
        plan, launcher="pdsh", launcher_args="-R ssh", exports={"NCCL_X": "a;b"}, cwd="/w"
    )
    assert label == "pdsh"
    assert argv[:-1] == ["pdsh", "-S", "-f", "1024", "-w", "127.0.0.2,127.0.0.3", "-R", "ssh"]
    remote = shlex.split(argv[-1])
    assert remote[:6] == ["cd", "/w", "&&", "exec", "env", "NCCL_X=a;b"]
    assert remote[6:11] == NODE and remote[12:] == ["--node_rank", "%n"]
    assert "'NCCL_X=a;b'" in argv[-1]  # quoted, so the ';' cannot start a second command
    assert plan.rendezvous.master_addr == "127.0.0.2"  # the first host by default


def test_srun_and_mpirun_argv(hostfile: Path) -> None:
    plan = plan_for(hostfile)
    [(_, srun)] = launch_commands(plan, launcher="slurm", launcher_args="--partition gpu", exports={"A": "1"}, cwd="/w")
    assert srun[:15] == [
        "srun",
        "--nodes",
        "2",
        "--ntasks",
        "2",
        "--ntasks-per-node",
        "1",
        "--nodelist",
        "127.0.0.2,127.0.0.3",
        "--kill-on-bad-exit=1",
        "--export=ALL",
        "--chdir",
        "/w",
        "--partition",
        "gpu",
    ]
    assert srun[15:20] == NODE and srun[21:] == ["--node_rank", "-1"]
    [(_, mpi)] = launch_commands(
        plan, launcher="openmpi", launcher_args="--bind-to none", exports={"B": "2", "A": "1"}, cwd="/w"
    )
    assert mpi[:17] == [
        "mpirun",
        "-n",
        "2",
        "--host",
        "127.0.0.2,127.0.0.3",
        "--map-by",
        "ppr:1:node",
        "--wdir",
        "/w",
        "-x",
        "A",
        "-x",
        "B",
        "--bind-to",
        "none",
        PY,
        "-u",
    ]
    assert mpi[15:20] == NODE and "1" not in mpi[:15] and "2" not in mpi[9:15]


@pytest.mark.parametrize(
    ("launcher", "settings"),
    [("mpich", []), ("impi", ["-genv", "I_MPI_PIN", "0"]), ("mvapich", ["-genv", "MV2_ENABLE_AFFINITY", "0"])],
)
def test_hydra_mpirun_argv(hostfile: Path, launcher: str, settings: list[str]) -> None:
    plan = plan_for(hostfile)
    [(label, argv)] = launch_commands(
        plan, launcher=launcher, launcher_args="-iface ib0", exports={"B": "secret", "A": "1"}, cwd="/w"
    )
    head = ["mpirun", "-n", "2", "-ppn", "1", "-hosts", "127.0.0.2,127.0.0.3", "-wdir", "/w", "-genvlist", "A,B"]
    assert label == "mpirun"
    assert argv[: len(head)] == head
    rest = argv[len(head) :]
    assert rest[: len(settings) + 2] == [*settings, "-iface", "ib0"]
    assert rest[len(settings) + 2 : len(settings) + 7] == NODE
    assert rest[-2:] == ["--node_rank", "-1"] and "secret" not in argv  # values travel in the environment


def test_remote_command_quotes_everything() -> None:
    command = multinode.remote_command(["python", "a b.py", "$(rm -rf /)"], cwd="/x; y", env={"K": "v'q"})
    assert shlex.split(command) == [
        "cd",
        "/x; y",
        "&&",
        "exec",
        "env",
        "K=v'q",
        "python",
        "a b.py",
        "$(rm -rf /)",
    ]


def test_per_rank_command_and_core_binding() -> None:
    assert build_command(["t.py", "--a"], local_rank=1, mode="script", no_local_rank=False) == [
        PY,
        "-u",
        "t.py",
        "--local_rank=1",
        "--a",
    ]
    assert build_command(["pkg.mod", "--a"], local_rank=0, mode="module", no_local_rank=True) == [
        PY,
        "-u",
        "-m",
        "pkg.mod",
        "--a",
    ]
    assert build_command(["/bin/prog", "x"], local_rank=2, mode="binary", no_local_rank=False) == [
        "/bin/prog",
        "--local_rank=2",
        "x",
    ]
    assert parse_core_list("1,3-5,7") == [1, 3, 4, 5, 7]
    with pytest.raises(ValueError, match="'5-9' overlaps or comes before core 6"):
        parse_core_list("0,2-6,5-9")
    with pytest.raises(ValueError, match="'2-6' overlaps or comes before core 8"):
        parse_core_list("8,2-6")
    with pytest.raises(ValueError, match="range '6-2' ends before it starts; write '2-6'"):
        parse_core_list("1,6-2")
    assert cores_for_rank(list(range(8)), local_rank=1, local_size=3) == [2, 3]
    with pytest.raises(ValueError, match="cannot be shared by 4 local ranks"):
        cores_for_rank([0, 1], local_rank=0, local_size=4)
    with pytest.raises(ValueError, match="bad item 'x'"):
        parse_core_list("0,x")


def test_local_world_honours_visible_devices() -> None:
    cvd = ["CUDA_VISIBLE_DEVICES"]
    world, from_file = resolve_world(parse(["t.py"]), {"CUDA_VISIBLE_DEVICES": "0,2"}, visible_envs=cvd, device_count=2)
    assert (world, from_file) == ({"localhost": [0, 2]}, False)
    world, _ = resolve_world(
        parse(["--num_gpus", "1", "t.py"]), {"CUDA_VISIBLE_DEVICES": "2,4"}, visible_envs=cvd, device_count=2
    )
    assert world == {"localhost": [2]}
    world, _ = resolve_world(
        parse(["-i", "localhost:2", "t.py"]),
        {"CUDA_VISIBLE_DEVICES": "0,2"},
        visible_envs=cvd,
        device_count=2,
    )
    assert world == {"localhost": [2]}
    plan = build_plan(parse(["t.py"]), {"localhost": [0, 2]}, multi=False, visible_envs=cvd)
    args = rank_exec_args(plan, host="localhost")
    assert args[args.index("--visible_devices") + 1] == "0,2" and args[-2:] == ["--", "t.py"]
    world, _ = resolve_world(parse(["--num_gpus", "3", "t.py"]), {}, visible_envs=[], device_count=1)
    assert world == {"localhost": [0, 1, 2]}


def test_world_resolution_errors(tmp_path: Path) -> None:
    with pytest.raises(HostfileError, match="cannot be combined with --num_nodes/--num_gpus"):
        resolve_world(parse(["-i", "a", "--num_gpus", "1", "t.py"]), {}, visible_envs=[], device_count=1)
    with pytest.raises(HostfileError, match=f"hostfile {tmp_path}/none does not exist"):
        resolve_world(parse(["-H", str(tmp_path / "none"), "t.py"]), {}, visible_envs=[], device_count=1)
    with pytest.raises(HostfileError, match="CUDA_VISIBLE_DEVICES='a,b'"):
        resolve_world(
            parse(["t.py"]),
            {"CUDA_VISIBLE_DEVICES": "a,b"},
            visible_envs=["CUDA_VISIBLE_DEVICES"],
            device_count=1,
        )
    with pytest.raises(ValueError, match="--module and --no_python exclude each other"):
        build_plan(parse(["--module", "--no_python", "t"]), {"localhost": [0]}, multi=False, visible_envs=[])


def test_node_rank_resolution() -> None:
    world = {"a": [0], "b.cluster": [0], "c": [0]}
    assert resolve_node_rank(world, 2, environ={}, hostname="x") == 2
    assert resolve_node_rank(world, -1, environ={}, hostname="b.cluster") == 1
    assert resolve_node_rank(world, -1, environ={"SLURM_NODEID": "2"}, hostname="x") == 2
    with pytest.raises(ValueError, match="host 'x' is not in the world"):
        resolve_node_rank(world, -1, environ={}, hostname="x")


def test_short_form_detection() -> None:
    subcommands = {"run", "report"}
    assert is_short_form(["train.py", "--x"], subcommands=subcommands)
    assert is_short_form(["--num_gpus", "2", "train.py"], subcommands=subcommands)
    assert not is_short_form(["report"], subcommands=subcommands)
    assert not is_short_form(["--help"], subcommands=subcommands)
    assert not is_short_form(["nonsense"], subcommands=subcommands)


@pytest.mark.parametrize("flag, value", [("--num_gpus", "0"), ("--num_gpus", "-2"), ("--num_nodes", "0")])
def test_non_positive_counts_are_named(flag: str, value: str) -> None:
    with pytest.raises(ValueError, match=rf"{flag} {value}: expected a positive count"):
        resolve_world(parse([flag, value, "t.py"]), {}, visible_envs=[], device_count=1)


def test_visible_devices_the_accelerator_ignores_get_a_note(capsys: pytest.CaptureFixture[str]) -> None:
    world, _ = resolve_world(
        parse(["--num_gpus", "2", "t.py"]), {"CUDA_VISIBLE_DEVICES": "1"}, visible_envs=[], device_count=1
    )
    assert world == {"localhost": [0, 1]}
    assert "CUDA_VISIBLE_DEVICES=1 is ignored" in capsys.readouterr().err
    resolve_world(parse(["t.py"]), {"CUDA_VISIBLE_DEVICES": "1"}, visible_envs=["CUDA_VISIBLE_DEVICES"], device_count=2)
    assert "ignored" not in capsys.readouterr().err


def test_a_busy_master_port_is_named() -> None:
    import socket

    from slipstream.launcher.runner import _busy_port_message

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        message = _busy_port_message("127.0.0.1", port)
        assert message is not None and f"--master_port {port} on 127.0.0.1" in message and "free port" in message
    assert _busy_port_message("127.0.0.1", port) is None

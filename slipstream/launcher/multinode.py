"""Command lines that start the per-node launch on every host: ssh, pdsh, Slurm `srun`, OpenMPI `mpirun`.

Owns the argv shapes; every builder returns `list[str]` for `subprocess.Popen`, never a shell string. The
per-node launch is (`node_argv`)::

    [PYTHON, "-u", "-m", "slipstream.launcher.node", "--plan", PLAN_B64, "--node_rank", N, ("--env_from_stdin")]

where PYTHON is the launcher's `sys.executable` (the same interpreter path must exist on every host),
PLAN_B64 is the base64 JSON of plan.LaunchPlan, and N is the node's index in the world (`%n` for pdsh,
`-1` under srun/mpirun: node.py then finds its host by name, or by SLURM_NODEID / OMPI_COMM_WORLD_RANK).

Where a remote shell runs the command (ssh, pdsh), it is one string built only from `shlex.join` pieces
(`remote_command`)::

    cd CWD && exec [env K=V ...] PYTHON -u -m slipstream.launcher.node ...

so the remote side starts in the launcher's working directory. The shapes:

- ssh (one per host): `["ssh", *shlex.split(LAUNCHER_ARGS), "-o", "BatchMode=yes", HOST, REMOTE]`.
  The environment travels as one JSON line on ssh's stdin (`--env_from_stdin`), never in an argv or a
  shell string; the pipe then stays open as a lifeline: when the runner closes it or dies, the node sees
  EOF and stops its ranks.
- pdsh: `["pdsh", "-S", "-f", "1024", "-w", "h1,h2", *LAUNCHER_ARGS, REMOTE]` with `--node_rank %n`; pdsh
  cannot feed stdin, so exports go in as `env K=V` argv items of REMOTE (shell-quoted by shlex.join;
  visible in the remote process table, so put secrets in a file the job reads instead).
- slurm: `["srun", "--nodes", N, "--ntasks", N, "--ntasks-per-node", "1", "--nodelist", "h1,h2",
  "--kill-on-bad-exit=1", "--export=ALL", "--chdir", CWD, *LAUNCHER_ARGS, *NODE_ARGV]`; exports are set in
  srun's own environment (Slurm propagates it), never in its argv.
- openmpi: `["mpirun", "-n", N, "--host", "h1,h2", "--map-by", "ppr:1:node", "--wdir", CWD,
  "-x", NAME, ..., *LAUNCHER_ARGS, *NODE_ARGV]`; `-x NAME` exports the value mpirun's environment holds.
- mpich, impi (Intel MPI), mvapich: the Hydra process manager's `mpirun`: `["mpirun", "-n", N, "-ppn", "1",
  "-hosts", "h1,h2", "-wdir", CWD, ("-genvlist", "A,B"), ("-genv", K, V ...), *LAUNCHER_ARGS, *NODE_ARGV]`;
  `-genvlist` exports the values mpirun's environment holds; `-genv` carries fixed settings only (Intel
  MPI's `I_MPI_PIN 0`, MVAPICH's `MV2_ENABLE_AFFINITY 0`: the one process per host starts every rank of
  that host, so MPI must not pin it to a core).
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Mapping

NODE_MODULE = "slipstream.launcher.node"
HYDRA_SETTINGS: dict[str, dict[str, str]] = {
    "mpich": {},
    "impi": {"I_MPI_PIN": "0"},
    "mvapich": {"MV2_ENABLE_AFFINITY": "0"},
}
"""The Hydra-based launchers and the fixed `-genv` settings each needs (see the module docstring)."""
LAUNCHERS = ("ssh", "pdsh", "slurm", "openmpi", *HYDRA_SETTINGS)


def node_argv(plan_token: str, *, node_rank: str, env_from_stdin: bool = False, python: str = "") -> list[str]:
    """The per-node launch command run on each host (see the module docstring)."""
    argv = [python or sys.executable, "-u", "-m", NODE_MODULE, "--plan", plan_token, "--node_rank", node_rank]
    return [*argv, "--env_from_stdin"] if env_from_stdin else argv


def remote_command(argv: list[str], *, cwd: str, env: Mapping[str, str] | None = None) -> str:
    """`cd CWD && exec [env K=V ...] ARGV` for a remote shell, every piece quoted by `shlex.join`."""
    env_items = ["env", *(f"{name}={value}" for name, value in sorted(env.items()))] if env else []
    return f"{shlex.join(['cd', cwd])} && exec {shlex.join([*env_items, *argv])}"


def ssh_argv(host: str, *, command: str, launcher_args: str = "") -> list[str]:
    """One host's ssh command; user options (`--launcher_args`) come first, so they win over ours."""
    return ["ssh", *shlex.split(launcher_args), "-o", "BatchMode=yes", host, command]


def pdsh_argv(hosts: list[str], *, command: str, launcher_args: str = "") -> list[str]:
    """One pdsh command for every host (run it with `PDSH_RCMD_TYPE=ssh` in its environment)."""
    return ["pdsh", "-S", "-f", "1024", "-w", ",".join(hosts), *shlex.split(launcher_args), command]


def srun_argv(hosts: list[str], *, argv: list[str], cwd: str, launcher_args: str = "") -> list[str]:
    """One Slurm step with one task per host; any task failing ends the step (`--kill-on-bad-exit`)."""
    count = str(len(hosts))
    return [
        "srun",
        "--nodes",
        count,
        "--ntasks",
        count,
        "--ntasks-per-node",
        "1",
        "--nodelist",
        ",".join(hosts),
        "--kill-on-bad-exit=1",
        "--export=ALL",
        "--chdir",
        cwd,
        *shlex.split(launcher_args),
        *argv,
    ]


def mpirun_argv(
    hosts: list[str], *, argv: list[str], cwd: str, export_names: list[str], launcher_args: str = ""
) -> list[str]:
    """One OpenMPI job with one process per host; values of `export_names` come from mpirun's environment."""
    exports = [item for name in sorted(export_names) for item in ("-x", name)]
    return [
        "mpirun",
        "-n",
        str(len(hosts)),
        "--host",
        ",".join(hosts),
        "--map-by",
        "ppr:1:node",
        "--wdir",
        cwd,
        *exports,
        *shlex.split(launcher_args),
        *argv,
    ]


def hydra_argv(
    hosts: list[str],
    *,
    argv: list[str],
    cwd: str,
    export_names: list[str],
    settings: Mapping[str, str] | None = None,
    launcher_args: str = "",
) -> list[str]:
    """One Hydra `mpirun` job (MPICH, Intel MPI, MVAPICH2) with one process per host; values of `export_names`
    come from mpirun's environment, `settings` are fixed `-genv` values (never user data)."""
    exports = ["-genvlist", ",".join(sorted(export_names))] if export_names else []
    fixed = [item for name, value in sorted((settings or {}).items()) for item in ("-genv", name, value)]
    return [
        "mpirun",
        "-n",
        str(len(hosts)),
        "-ppn",
        "1",
        "-hosts",
        ",".join(hosts),
        "-wdir",
        cwd,
        *exports,
        *fixed,
        *shlex.split(launcher_args),
        *argv,
    ]

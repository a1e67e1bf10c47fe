"""DeepSpeed's `deepspeed.launcher.multinode_runner`: one class per multi-node backend, whose `get_cmd` builds the
command that starts a job on the hosts of `active_resources`.

The classes keep DeepSpeed's constructors, `exports`/`add_export`, `name`, `backend_exists` and `get_cmd`
return shapes (`PDSHRunner` returns `(cmd, kill_cmd, environment)`, the others the argv), and build
Slipstream's command for the backend: the per-node launch of launcher/multinode.py on every host, which
starts that host's ranks under PyTorch's elastic agent. So:

- an MPI backend's `mpirun` starts one process per *host* (DeepSpeed's starts one per rank), and hosts with
  different slot counts, `--include`/`--exclude` and `--num_nodes`/`--num_gpus` work with every backend
  (the launch plan carries the world); core binding is the launcher's own (`--bind_cores_to_rank`);
- `exports` holds shell words, as in DeepSpeed (`add_export` double-quotes a value with characters a shell
  would read: `64(x2)` -> `"64(x2)"`); the command carries the values a shell gives those words. pdsh puts
  them into the remote command as `env K=V` items; the MPI backends and Slurm set them in `environment`
  (which the caller passes to Popen, as DeepSpeed's runner does) and name them in the argv (`-x NAME`,
  `-genvlist NAMES`; srun's `--export=ALL`), so values stay out of the process table;
- OpenMPI keeps DeepSpeed's defaults `--mca btl ^openib` and `--mca btl_tcp_if_include eth0` (the latter
  left out when the launcher arguments name `btl_tcp_if_include`), and adds `UCX_TLS=tcp` to the exports;
  MVAPICH adds DeepSpeed's `MV2_*` exports.

DeepSpeed's `--save_pid` has no counterpart: a runner given `save_pid` raises NotImplementedError.
"""

from __future__ import annotations

import abc
import argparse
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, ClassVar

from slipstream.launcher import multinode, runner
from slipstream.launcher.hostfile import World
from slipstream.launcher.plan import encode_plan

__all__ = [
    "IMPIRunner",
    "MPICHRunner",
    "MVAPICHRunner",
    "MultiNodeRunner",
    "OpenMPIRunner",
    "PDSHRunner",
    "SlurmRunner",
]

_SHELL_SAFE = re.compile(r"[\w@%+=:,./-]*")
"""Characters a shell reads literally in an unquoted word (DeepSpeed's set)."""


def _world(active_resources: Mapping[str, Any]) -> World:
    """host -> slot ids; a slot count N (DeepSpeed's resource pool) means slots 0..N-1."""
    return {
        str(host): list(range(slots)) if isinstance(slots, int) else [int(slot) for slot in slots]
        for host, slots in active_resources.items()
    }


class MultiNodeRunner(abc.ABC):
    """A multi-node backend: `args` are the launcher's parsed flags (`runner.parse_args`, or DeepSpeed's)."""

    def __init__(self, args: Any, world_info_base64: str) -> None:
        self.args = args
        self.validate_args()
        self.user_arguments: list[str] = self.parse_user_args()
        self.user_script: str = args.user_script
        self.world_info_base64 = world_info_base64
        self.exports: dict[str, str] = {}
        self._added: dict[str, tuple[str, str]] = {}  # name -> (the word in `exports`, the value add_export got)

    @abc.abstractmethod
    def backend_exists(self) -> bool:
        """Whether this backend's program is installed here."""

    @abc.abstractmethod
    def get_cmd(self, environment: MutableMapping[str, str], active_resources: Mapping[str, Any]) -> Any:
        """The command that starts the job on the hosts of `active_resources` (host -> slots)."""

    def add_export(self, key: str, var: str) -> None:
        """Export `key`=`var` to every node; a value with shell-special characters is stored double-quoted."""
        value = var.strip()
        word = value if _SHELL_SAFE.fullmatch(value) else f'"{value}"'
        self.exports[key.strip()] = word
        self._added[key.strip()] = (word, value)

    def parse_user_args(self) -> list[str]:
        """The user script's arguments (each one argv item: no backend here re-splits them)."""
        return list(self.args.user_args)

    @property
    def name(self) -> str:
        """The backend's name (`--launcher` value for the built-in ones)."""
        return self.__class__.__name__

    def validate_args(self) -> None:
        """Reject flags this backend cannot honour (none for the built-in backends)."""
        if getattr(self.args, "save_pid", False):
            raise NotImplementedError(
                "--save_pid (DeepSpeed's launcher writes its pid to /tmp/<pid>.deepspeed): Slipstream's launcher "
                "has no pid file; the runner's own pid is the job's (it stops every node when signalled)"
            )

    # ------------------------------------------------------------------ shared by the built-in backends
    def export_values(self) -> dict[str, str]:
        """`exports` as values: what `add_export` was given, or, for a word set in `exports` directly, the value
        a shell gives it (`"64(x2)"` -> `64(x2)`); ValueError names a word a shell cannot read."""
        values: dict[str, str] = {}
        for name, word in self.exports.items():
            added = self._added.get(name)
            if added is not None and added[0] == word:
                values[name] = added[1]
                continue
            try:
                values[name] = " ".join(shlex.split(word))
            except ValueError as error:
                raise ValueError(
                    f"exports[{name!r}] = {word!r} is not a shell word ({error}); use add_export"
                ) from None
        return values

    def node_command(self, active_resources: Mapping[str, Any], *, node_rank: str) -> tuple[list[str], list[str]]:
        """(hosts, the per-node launch argv) for this job: the launch plan built from `args` and the world."""
        from slipstream.accelerator import get_accelerator

        world = _world(active_resources)
        defaults = vars(runner.parse_args([self.user_script]))
        given = {key: value for key, value in vars(self.args).items() if key in defaults}
        args = argparse.Namespace(**{**defaults, **given, "user_args": list(self.user_arguments)})
        plan = runner.build_plan(args, world, multi=True, visible_envs=list(get_accelerator().visible_devices_envs()))
        return list(world), multinode.node_argv(encode_plan(plan), node_rank=node_rank)

    def launcher_args(self) -> str:
        return str(getattr(self.args, "launcher_args", "") or "")


class _BuiltinRunner(MultiNodeRunner):
    """A built-in backend: named by its `--launcher` value, installed when its `program` is on PATH."""

    launcher: ClassVar[str]
    program: ClassVar[str]

    @property
    def name(self) -> str:
        return self.launcher

    def backend_exists(self) -> bool:
        return shutil.which(self.program) is not None


class PDSHRunner(_BuiltinRunner):
    """pdsh to every host at once (`PDSH_RCMD_TYPE=ssh`); node ranks from pdsh's `%n`."""

    launcher = "pdsh"
    program = "pdsh"

    def get_cmd(
        self, environment: MutableMapping[str, str], active_resources: Mapping[str, Any]
    ) -> tuple[list[str], list[str], MutableMapping[str, str]]:
        """(pdsh command, the pdsh command that kills this job's node launches, `environment` updated)."""
        environment["PDSH_RCMD_TYPE"] = "ssh"
        port = getattr(self.args, "ssh_port", None)
        if port is not None:
            environment["PDSH_SSH_ARGS_APPEND"] = f"{environment.get('PDSH_SSH_ARGS_APPEND', '')} -p {port}".strip()
        hosts, argv = self.node_command(active_resources, node_rank="%n")
        command = multinode.remote_command(argv, cwd=os.path.abspath("."), env=self.export_values())
        venv_script = getattr(self.args, "venv_script", None)
        if venv_script:
            command = f"{shlex.join(['source', venv_script])} && {command}"
        token = argv[argv.index("--plan") + 1]
        kill = shlex.join(["pkill", "-f", f"{multinode.NODE_MODULE} --plan {token}"])
        return (
            multinode.pdsh_argv(hosts, command=command, launcher_args=self.launcher_args()),
            multinode.pdsh_argv(hosts, command=kill),
            environment,
        )


class _MPIRunner(_BuiltinRunner):
    """An MPI backend: one process per host; `resource_pool` is DeepSpeed's host -> slot count."""

    def __init__(self, args: Any, world_info_base64: str, resource_pool: Mapping[str, Any]) -> None:
        super().__init__(args, world_info_base64)
        self.resource_pool = resource_pool

    def exported_names(self, environment: MutableMapping[str, str]) -> list[str]:
        """Put the exports' values into `environment` and return their names."""
        values = self.export_values()
        environment.update(values)
        return sorted(values)

    def _mpi_argv(
        self,
        environment: MutableMapping[str, str],
        active_resources: Mapping[str, Any],
        build: Callable[..., list[str]],
        **options: object,
    ) -> list[str]:
        """`build` (multinode.mpirun_argv or hydra_argv) run for one node launcher per host from this directory,
        with the exports (put into `environment`) and the backend's own `options`."""
        hosts, argv = self.node_command(active_resources, node_rank="-1")
        cwd, names = os.path.abspath("."), self.exported_names(environment)
        return build(hosts, argv=argv, cwd=cwd, export_names=names, **options)


class OpenMPIRunner(_MPIRunner):
    """OpenMPI's `mpirun` (`--map-by ppr:1:node`), with DeepSpeed's `--mca` defaults."""

    launcher = "openmpi"
    program = "ompi_info"

    def __init__(self, args: Any, world_info_base64: str, resource_pool: Mapping[str, Any]) -> None:
        super().__init__(args, world_info_base64, resource_pool)
        self.add_export("UCX_TLS", "tcp")

    def get_cmd(self, environment: MutableMapping[str, str], active_resources: Mapping[str, Any]) -> list[str]:
        user = shlex.split(self.launcher_args())
        names_nic = any(
            flag in ("-mca", "--mca") and value == "btl_tcp_if_include" for flag, value in zip(user, user[1:])
        )
        defaults = ["--mca", "btl", "^openib", *([] if names_nic else ["--mca", "btl_tcp_if_include", "eth0"])]
        launcher_args = shlex.join([*defaults, *user])
        return self._mpi_argv(environment, active_resources, multinode.mpirun_argv, launcher_args=launcher_args)


class MPICHRunner(_MPIRunner):
    """MPICH's Hydra `mpirun` (`-ppn 1 -hosts ...`)."""

    launcher = "mpich"
    program = "mpirun"

    def get_cmd(self, environment: MutableMapping[str, str], active_resources: Mapping[str, Any]) -> list[str]:
        settings = multinode.HYDRA_SETTINGS[self.launcher]
        return self._mpi_argv(
            environment, active_resources, multinode.hydra_argv, settings=settings, launcher_args=self.launcher_args()
        )


class IMPIRunner(MPICHRunner):
    """Intel MPI's Hydra `mpirun`, with its own process pinning off (`-genv I_MPI_PIN 0`)."""

    launcher = "impi"


class MVAPICHRunner(MPICHRunner):
    """MVAPICH2's Hydra `mpirun`, with DeepSpeed's `MV2_*` exports."""

    launcher = "mvapich"

    def __init__(self, args: Any, world_info_base64: str, resource_pool: Mapping[str, Any]) -> None:
        super().__init__(args, world_info_base64, resource_pool)
        from slipstream.accelerator import get_accelerator

        settings = {
            "MV2_SMP_USE_CMA": "0",  # the CMA kernel module is missing on Ubuntu
            "MV2_DEBUG_SHOW_BACKTRACE": "1",
            "MV2_SUPPORT_DL": "1",
            "MV2_ENABLE_AFFINITY": "0",
            "MV2_INTER_ALLGATHER_TUNING": "5",
            "MV2_CUDA_USE_NAIVE": "0",
        }
        if get_accelerator().device_name() == "cuda":
            settings["MV2_USE_CUDA"] = "1"
        for name, value in settings.items():
            self.add_export(name, value)

    def backend_exists(self) -> bool:
        """True when `mpiname` reports MVAPICH2-GDR (DeepSpeed's check)."""
        if shutil.which("mpiname") is None:
            return False
        result = subprocess.run(["mpiname"], capture_output=True, text=True, check=False)
        return "MVAPICH2-GDR" in result.stdout


class SlurmRunner(_MPIRunner):
    """Slurm's `srun`, one task per host (`--ntasks-per-node 1 --export=ALL`)."""

    launcher = "slurm"
    program = "sinfo"

    def get_cmd(self, environment: MutableMapping[str, str], active_resources: Mapping[str, Any]) -> list[str]:
        self.exported_names(environment)  # srun's --export=ALL passes its environment on
        comment = getattr(self.args, "slurm_comment", "")
        extra = shlex.join(["--comment", comment]) + " " if comment else ""
        hosts, argv = self.node_command(active_resources, node_rank="-1")
        return multinode.srun_argv(
            hosts, argv=argv, cwd=os.path.abspath("."), launcher_args=extra + self.launcher_args()
        )

"""DeepSpeed's `deepspeed.launcher.constants`: the `--launcher` names of the multi-node backends (the values
`deepspeed --launcher` and `slipstream run --launcher` accept; compat/multinode_runner.py builds their
commands) and the few fixed values that go with them."""

from __future__ import annotations

PDSH_LAUNCHER = "pdsh"
PDSH_MAX_FAN_OUT = 1024
OPENMPI_LAUNCHER = "openmpi"
MPICH_LAUNCHER = "mpich"
IMPI_LAUNCHER = "impi"
SLURM_LAUNCHER = "slurm"
MVAPICH_LAUNCHER = "mvapich"
MVAPICH_TMP_HOSTFILE = "/tmp/deepspeed_mvapich_hostfile"

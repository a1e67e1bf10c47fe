"""Starting the default process group: from the launcher's environment, or a one-rank group without one.

`init_distributed` keeps DeepSpeed's signature. With `RANK`/`WORLD_SIZE`/`MASTER_ADDR`/`MASTER_PORT` set
(torchrun, `slipstream run`, DeepSpeed's launcher) it joins that job. Without them it starts a world of
one in-process (a `HashStore`), so a script runs as `python train.py` with no launcher at all. The
backend is the accelerator's (`gloo` on CPU, `nccl` on CUDA) unless given. Under `slipstream run`, whose
console lines already start with `[rank<N>]:`, the prefix torch's excepthook puts on traceback lines is dropped.
"""

from __future__ import annotations

import datetime
import logging
import os

import torch.distributed as dist

logger = logging.getLogger("slipstream")

_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
TORCH_DISTRIBUTED_DEFAULT_PORT = 29500


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT,
    verbose: bool = True,
    timeout: datetime.timedelta | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: object = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Start the default process group unless one exists (DeepSpeed's signature; see module doc).

    `timeout` becomes the collective timeout (Slipstream's deadline and the group's own); without it the group
    gets the collective timeout (SLIPSTREAM_TIMEOUT seconds / DEEPSPEED_TIMEOUT minutes / 5 min). The group is
    torn down at exit as [Note: process group teardown] in teardown.py says.
    """
    del auto_mpi_discovery, config  # accepted for DeepSpeed compatibility; MPI discovery comes with the launcher
    from slipstream.comm.collectives import collective_timeout, set_collective_timeout

    if timeout is not None:
        set_collective_timeout(timeout.total_seconds())  # reaches an existing group too (set_timeout)
    if is_initialized():
        _one_line_prefix()
        return
    if dist_init_required is False:
        raise RuntimeError(
            "dist_init_required=False but torch.distributed is not initialized; initialize it "
            "first or pass dist_init_required=None"
        )
    from slipstream.accelerator import get_accelerator
    from slipstream.comm import teardown

    backend = dist_backend or get_accelerator().communication_backend_name()
    _create_group(
        backend,
        collective_timeout(),
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        distributed_port=distributed_port,
    )
    teardown.install(created=True)
    _one_line_prefix()
    if verbose:
        logger.info(
            "initialized torch.distributed: backend=%s rank=%d world_size=%d",
            backend,
            dist.get_rank(),
            dist.get_world_size(),
        )


def _create_group(
    backend: str,
    timeout: datetime.timedelta,
    *,
    init_method: str | None,
    rank: int,
    world_size: int,
    distributed_port: int,
) -> None:
    """The default group: from an explicit `init_method`/`rank`, the launcher's environment, or a world of one
    (no launcher variable set); a partly set launcher environment is an error."""
    from slipstream.accelerator import get_accelerator

    missing = [name for name in _LAUNCHER_VARS if name not in os.environ]
    if init_method is not None or rank >= 0:
        os.environ.setdefault("MASTER_PORT", str(distributed_port))
        dist.init_process_group(backend, init_method=init_method, timeout=timeout, rank=rank, world_size=world_size)
    elif not missing:
        if "LOCAL_RANK" in os.environ:
            get_accelerator().set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend, timeout=timeout)
    elif len(missing) == len(_LAUNCHER_VARS):
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        raise RuntimeError(
            f"the launcher environment is incomplete: {', '.join(missing)} not set while "
            f"{', '.join(n for n in _LAUNCHER_VARS if n not in missing)} are; start the script "
            "with torchrun / `slipstream run`, or unset them all for a single process"
        )


def _one_line_prefix() -> None:
    """Under `slipstream run`, which prefixes every line of a rank's output with `[rank<N>]:`, drop the
    prefix torch's excepthook adds to traceback lines, so they carry one prefix like every other line."""
    if os.environ.get("SLIPSTREAM_PREFIXED_OUTPUT") == "1":
        from slipstream.utils.torch_shim import drop_traceback_rank_prefix

        drop_traceback_rank_prefix()

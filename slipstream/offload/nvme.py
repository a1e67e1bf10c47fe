"""ZeRO-Infinity's optimizer offload to NVMe: fp32 masters and optimizer states live in files, not in memory.

[Note: NVMe swapping]
- `NVMeOffload` is a `CPUOffload` (the step runs on the host, in the CPU Adam op) whose master buffers and
  optimizer-state tensors are *swappable*: between steps their storage is resized to zero bytes and their
  values live in files under `nvme_path/slipstream-<pid>-rank<r>-optimizer<n>/` (mode 0700, files 0600). Views of them
  (the master pieces the optimizer steps) stay valid, as with ZeRO-3's full buffers. Each engine has its own
  directory (`slipstream-<pid>-rank<r>-optimizer<n>`), so several engines in one process never share files.
- The step runs one sub-group at a time (`zero_optimization.sub_group_size` elements of a param group at stage
  3, a whole param group below): its tensors are read back (the next sub-group's read is started before this
  one's update, so reads overlap compute), it is updated, and its tensors are written out and released. Host
  memory holds two sub-groups' masters and states at once, whatever the model's size. Masters are written out
  as each sub-group's buffer is filled (`settle`), and Adam's states are created at a sub-group's first update
  and written out right after, so neither is ever resident for the whole model.
- I/O goes through the `async_io` op (native, or its thread-pool fallback); any failed or short request
  raises `AsyncIOError` naming the file, offset and size, and the step stops: stale values are never used.
- At start the directory must exist, be writable and have room for masters + states (checked with
  numbers); the run's directory is removed at exit. A directory left by a crashed run (its pid is gone) is
  removed first, so old data is never mixed with new.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import itertools
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch

from slipstream.config.plan import (
    RESIDENT_GRAD_SUB_GROUPS,
    AioPlan,
    NvmeTarget,
    OffloadTarget,
    nvme_gradients_in_files,
)
from slipstream.config.zero_plans import default_aio_plan
from slipstream.offload.policy import CPUOffload, OffloadPolicy, SteppedGroups
from slipstream.offload.swapper import Swapper
from slipstream.utils.logging import log_rank0

_PREFIX = "slipstream-"
_instances = itertools.count()
"""Several engines in one process each get their own directory (their swap files must never mix)."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale_dirs(root: Path, rank: int) -> list[str]:
    """Remove run directories of this rank left by processes that no longer exist; returns what was removed."""
    removed = []
    for path in root.glob(f"{_PREFIX}*-rank{rank}-*"):
        try:
            pid = int(path.name[len(_PREFIX) :].split("-")[0])
        except ValueError:
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    return removed


def check_nvme_path(nvme_path: str, *, key: str) -> None:
    """Stop with the config key when `nvme_path` is not a writable directory."""
    root = Path(nvme_path)
    if not root.is_dir() or not os.access(root, os.W_OK):
        raise ValueError(
            f"zero_optimization.{key}={nvme_path!r} is not a writable directory; create it (on a fast "
            "local disk) or point nvme_path at one"
        )


def make_run_dir(nvme_path: str, rank: int, role: str, *, key: str) -> Path:
    """This engine's directory under `nvme_path` (mode 0700, removed at exit), after checking the path and
    removing what dead runs left there."""
    check_nvme_path(nvme_path, key=key)
    root = Path(nvme_path)
    for path in clean_stale_dirs(root, rank):
        log_rank0(f"offload: removed {path}, left by a run that no longer exists", rank=rank)
    directory = root / f"{_PREFIX}{os.getpid()}-rank{rank}-{role}{next(_instances)}"
    directory.mkdir(mode=0o700, exist_ok=True)
    atexit.register(shutil.rmtree, directory, True)
    return directory


class NVMeShardStore:
    """ZeRO-3 parameter offload to NVMe: a unit's shard is read in for a gather or an update and released
    after (written back only when it changed). Each shard has its own file, removed by `discard` when the unit
    is dropped (zero.Init's units once the engine has taken their values), so disk use follows the live units."""

    in_memory = False

    def __init__(self, nvme_path: str, rank: int, aio: AioPlan, *, role: str = "params") -> None:
        self.directory = make_run_dir(nvme_path, rank, role, key="offload_param.nvme_path")
        self.swapper = Swapper(self.directory, aio)
        self._names: dict[int, str] = {}
        self._count = itertools.count()

    def _name(self, shard: torch.Tensor) -> str:
        name = self._names.get(id(shard))
        if name is None:
            name = self._names[id(shard)] = f"shard{next(self._count)}"
        return name

    def fetch(self, shard: torch.Tensor) -> None:
        self.swapper.finish_swap_in([shard])

    def release(self, shard: torch.Tensor, *, dirty: bool) -> None:
        if dirty:
            self.swapper.swap_out([(shard, self._name(shard))])
        else:
            self.swapper.drop([(shard, self._name(shard))])

    def discard(self, shard: torch.Tensor) -> None:
        name = self._names.pop(id(shard), None)
        self.swapper.forget(shard)
        if name is not None:
            (self.directory / f"{name}.swp").unlink(missing_ok=True)


@dataclasses.dataclass
class NVMeOffload(CPUOffload):
    """CPU offload whose masters and optimizer states (or stage 3's parameter shards) are swapped to `nvme_path`
    between uses. Building one checks the path; the optimizer's directory is made when first used."""

    nvme_path: str = ""
    aio: AioPlan = dataclasses.field(default_factory=default_aio_plan)
    rank: int = 0
    grad_buffers: int = RESIDENT_GRAD_SUB_GROUPS
    """Stage 3: gradient buffers resident at once while backward adds into them ([Note: swapped gradients])."""
    section: str = "offload_optimizer"
    """The config section this policy came from ("offload_optimizer" or "offload_param"), named in errors."""
    gradients: Any = dataclasses.field(default=None, init=False)
    """The `GradientSwap` of a stage-3 optimizer (None below stage 3, whose gradients stay in memory)."""
    in_files: ClassVar[bool] = True
    _files: tuple[Path, Swapper] | None = dataclasses.field(default=None, init=False, repr=False)
    _swaps_gradients: bool | None = dataclasses.field(default=None, init=False, repr=False)

    @classmethod
    def from_target(cls, target: OffloadTarget, *, rank: int, section: str) -> OffloadPolicy:
        assert isinstance(target, NvmeTarget), f"NVMeOffload is the policy of NvmeTarget, not {target!r}"
        return cls(pin_memory=target.pin_memory, nvme_path=target.path, rank=rank, aio=target.aio, section=section)

    def __post_init__(self) -> None:
        check_nvme_path(self.nvme_path, key=f"{self.section}.nvme_path")

    @property
    def swaps_gradients(self) -> bool:
        """`SLIPSTREAM_NVME_GRADIENTS`, read when the stage-3 optimizer first asks (as it is built)."""
        if self._swaps_gradients is None:
            self._swaps_gradients = nvme_gradients_in_files()
        return self._swaps_gradients

    def pins_with(self, requested: bool) -> bool:
        return False  # swappable storages are resized; pinned host memory cannot be

    @classmethod
    def pins_configured(cls, pin_memory: bool) -> bool:
        return False

    @property
    def directory(self) -> Path:
        """This optimizer's directory of swap files (made on first use)."""
        return self._open_files()[0]

    @property
    def swapper(self) -> Swapper:
        return self._open_files()[1]

    def _open_files(self) -> tuple[Path, Swapper]:
        if self._files is None:
            directory = make_run_dir(self.nvme_path, self.rank, "optimizer", key=f"{self.section}.nvme_path")
            self._files = (directory, Swapper(directory, self.aio))
        return self._files

    def make_param_store(self, *, role: str = "params") -> NVMeShardStore:
        return NVMeShardStore(self.nvme_path, self.rank, self.aio, role=role)

    def swap_gradients(self, buffers: list[tuple[torch.Tensor, str]]) -> Any:
        """Take stage 3's gradient buffers (one per sub-group, in stepping order) into files; returns their
        `GradientSwap`."""
        from slipstream.offload.grad_swap import GradientSwap

        self.gradients = GradientSwap(self.swapper, buffers, limit=self.grad_buffers)
        return self.gradients

    # ---- step hooks (see offload/policy.py) ----
    def settle(self, tensors: list[tuple[torch.Tensor, str]]) -> None:
        self.swapper.swap_out(tensors)

    def prepare(self, groups: SteppedGroups) -> None:
        """Check the room for what is still to be written (the masters still in memory, two Adam-sized states per
        master element, the gradient files), then move every sub-group to its files."""
        self.check_room(self.bytes_to_write(groups))
        for index in range(groups.num_sub_groups):
            self.swapper.swap_out(groups.swappable(index))

    def bytes_to_write(self, groups: SteppedGroups) -> int:
        """File bytes this rank's optimizer has yet to write: masters not yet in their files (stage 3 writes each
        sub-group's as it is built, so they already take their room on the disk), Adam's two fp32 states per
        master element (created at the first step) and the swapped gradients."""
        count = groups.num_sub_groups
        unwritten = sum(
            t.numel() * t.element_size()
            for i in range(count)
            for t, _ in groups.swappable(i)
            if self.swapper.resident(t)
        )
        states = 2 * 4 * sum(groups.sub_group_numel(i) for i in range(count))
        return unwritten + states + (self.gradients.file_bytes() if self.gradients is not None else 0)

    def run_step(self, groups: SteppedGroups) -> bool:
        """One sub-group at a time: its tensors are read in (the next one's read overlaps this update),
        updated, copied into the parameters, and written back out."""
        count, gradients = groups.num_sub_groups, self.gradients
        if gradients is not None and count:
            gradients.prefetch(0)  # read with the first sub-group's masters and states
            self.swapper.start_swap_in([t for t, _ in groups.swappable(0)])
        for index in range(count):
            if gradients is not None:
                gradients.fetch(index)
            self.swapper.finish_swap_in([t for t, _ in groups.swappable(index)])
            if index + 1 < count:
                if gradients is not None:
                    gradients.prefetch(index + 1)
                self.swapper.start_swap_in([t for t, _ in groups.swappable(index + 1)])
            groups.step_sub_group(index)
            self.swapper.swap_out(groups.swappable(index))
            if gradients is not None:
                gradients.discard(index)  # used up: never written back
        return True

    @contextlib.contextmanager
    def resident(self, groups: SteppedGroups) -> Iterator[None]:
        for index in range(groups.num_sub_groups):
            self.swapper.finish_swap_in([t for t, _ in groups.swappable(index)])
        try:
            yield
        finally:
            for index in range(groups.num_sub_groups):
                self.swapper.swap_out(groups.swappable(index))

    def resident_master_bytes(self, master_bytes: list[int]) -> int:
        """The sub-group being updated and the next one, being read."""
        return sum(sorted(master_bytes, reverse=True)[:2])

    def resident_grad_bytes(self, grad_bytes: list[int]) -> int:
        """Stage 3's swapped gradients: the `grad_buffers` kept, plus the one stepped and the next (a bound)."""
        if self.gradients is None:
            return 0
        return sum(sorted(grad_bytes, reverse=True)[: self.grad_buffers + 2])

    def check_room(self, needed_bytes: int) -> None:
        """Stop with numbers when the NVMe file system lacks room for what this rank will write there."""
        free = shutil.disk_usage(self.directory).free
        if needed_bytes > free:
            raise RuntimeError(
                f"NVMe offload needs {needed_bytes / 2**30:.2f} GiB on {self.nvme_path} for this rank "
                f"(fp32 master weights and optimizer states) but only {free / 2**30:.2f} GiB is free; "
                "free space, use another nvme_path, or offload to cpu"
            )

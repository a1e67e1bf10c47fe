"""One ZeRO-3 unit: its shard, its full buffer, and its two collectives (gather, gradient reduce-scatter).

See [Note: ZeRO-3 vocabulary] in __init__.py. The gather: this rank's shard (and a one-element unit tag)
goes into its row of a pooled rank-major buffer, one `all_gather` fills the other rows, and each
parameter's rows are copied into the full buffer, whose storage is re-grown for the purpose. The tag
row catches ranks that gathered different units at the same point (rank-dependent control flow around
unit boundaries), which would otherwise mix two units' values silently. The reduce-scatter: each
trainable parameter's gradient is packed into its columns of a pooled rank-major staging buffer (zeros
for parameters without a gradient on this rank), one `reduce_scatter` leaves this rank's columns, and
those are added into the optimizer's gradient shards.

[Note: aliases of gathered values] Releasing a unit resizes its buffer's storage to 0 bytes and the next
gather grows the same storage again, so the module hooks reuse one allocation per unit and tensors autograd
saved in the forward (views of the parameters) see the values again in the backward. A tensor that still
shares the storage after the release would point at freed memory: reading it raises "data is not allocated
yet" or, in torch 2.13 on the CPU, kills the process with SIGSEGV. User code inside GatheredParameters (or
unwrap_model_for_generation) may keep such tensors -- `state_dict()` values, `p.detach()`, views -- and they
stay valid in DeepSpeed, so those gathers mark the unit `exposed`. Releasing an exposed unit whose storage
has other users (torch's use count of the storage) leaves that storage to them, freed when the last of them
dies, and gives the unit and its parameters a fresh one. The aliases then keep the values of the gather.
Hook gathers never do this: their aliases are autograd's saved views, which must see the regathered storage.
The gather buffers of the pool are copied into the unit's buffer, never aliased, so reusing them cannot change
what an alias sees.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from slipstream.comm import collectives
from slipstream.offload.policy import CPUOffload, ParamStore
from slipstream.precision.fp8 import Float8WeightSlot
from slipstream.utils.torch_shim import storage_use_count
from slipstream.zero.comm_stream import CommStream
from slipstream.zero.quantized import QuantizedRows
from slipstream.zero.stage3.dtype_split import any_reduce_dtype, dtype_parts, launch_parts
from slipstream.zero.stage3.fp8_gather import Float8Rows
from slipstream.zero.stage3.hierarchical_gather import HierarchicalGather
from slipstream.zero.stage3.pool import BufferPool
from slipstream.zero.stage3.quantized_reduce import QuantizedReduceScatter
from slipstream.zero.stage3.secondary import SecondaryShard
from slipstream.zero.stage3.sharded_param import ParamRecord, ZeroParamStatus, internal_access, make_sharded
from slipstream.zero.stage3.units import UnitSpec, shard_layout


class ShardStore:
    """Where a unit's shard lives between uses: in memory (this class: nothing to do), or in a file
    (offload/nvme.py NVMeShardStore: `fetch` reads it in, `release` frees it, writing it back when dirty)."""

    in_memory = True
    """The shard stays in memory between uses (views of it stay valid)."""

    def fetch(self, shard: torch.Tensor) -> None:
        return None

    def release(self, shard: torch.Tensor, *, dirty: bool) -> None:
        return None

    def discard(self, shard: torch.Tensor) -> None:
        """The unit is dropped: its shard's values are no longer needed."""
        return None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class UnitMemory:
    """Where the units of one manager keep their memory: the full buffers on `device` (gather buffers from
    `pool`), the shards made by `allocate_shard` on `shard_device` and kept by `store` (None: in memory)."""

    device: torch.device
    shard_device: torch.device
    pool: BufferPool
    allocate_shard: Callable[[int, torch.dtype, torch.device], torch.Tensor]
    store: ParamStore | None = None


class UnitOrderError(RuntimeError):
    """Ranks gathered different units at the same collective (their control flow differed)."""


class Unit:
    """Buffers and collectives of one unit. `manager` is the ZeroModel that owns it."""

    quantized_reduce: QuantizedReduceScatter | None = None
    """How the gradients travel quantized (ZeRO++ qgZ; set by the ZeroModel), or None: the exact reduce-scatter."""
    hierarchical: HierarchicalGather | None = None
    """MiCS' two-step gather across nodes then inside the node (set by the ZeroModel; hierarchical_gather.py), or
    None: one all-gather over the group."""
    _lent: torch.Tensor | None = None
    """While gathered: the pool's buffer whose memory `full` holds ([Note: lent gathered memory] in pool.py)."""
    comm: CommStream | None = None
    """The engine's communication stream the gathers are launched on (set by the ZeroModel), or None: the current
    stream. See [Note: the communication stream] in zero/comm_stream.py."""

    def __init__(
        self,
        uid: int,
        spec: UnitSpec,
        *,
        manager: Any,
        rank: int,
        world_size: int,
        group: dist.ProcessGroup | None,
        memory: UnitMemory,
        quantize_gathers: bool = False,
        fp8_slots: dict[int, Float8WeightSlot] | None = None,
    ) -> None:
        """`quantize_gathers`: the gathers of the module hooks travel as block-wise int8 (zero/quantized.py);
        else `fp8_slots` (parameter index -> slot of a float8 layer's weight): those weights travel in float8
        (fp8_gather.py)."""
        params = [p for _, p in spec.params]
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            raise ValueError(
                f"ZeRO-3 unit '{spec.name}' mixes parameter dtypes {sorted(map(str, dtypes))}; cast "
                "the model to one dtype first"
            )
        self.uid, self.name, self.module, self.persistent = uid, spec.name, spec.module, spec.persistent
        self.manager, self.rank, self.world_size, self.group = manager, rank, world_size, group
        self.device, self.pool = memory.device, memory.pool
        self.store = memory.store if memory.store is not None else ShardStore()
        self.params: list[nn.Parameter] = params
        self.dtype = params[0].dtype if params else torch.float32
        self.layout = shard_layout([p.numel() for p in params], world_size)
        self.tag = float(uid % 251 + 1)
        self.status = ZeroParamStatus.AVAILABLE
        self.active_modules: set[int] = set()
        self.shard = memory.allocate_shard(self.layout.shard_numel, self.dtype, memory.shard_device)
        # torch.empty touches no pages: construction costs the shard, not a second copy of the unit
        self.full = torch.empty(self.layout.full_numel, dtype=self.dtype, device=self.device)
        self.full_bytes = self.full.untyped_storage().nbytes()
        self._pending: tuple[Any, torch.Tensor, QuantizedRows | Float8Rows | SecondaryShard | None] | None = None
        self.secondary: SecondaryShard | None = None
        """ZeRO++ hpZ: where the hook gathers read once a gather filled it (set by the ZeroModel; secondary.py)."""
        self.quantized = QuantizedRows(self.layout.shard_numel) if quantize_gathers and world_size > 1 else None
        """How the hooks' gathers travel quantized (ZeRO++ qwZ), or None: always exact."""
        self.float8 = (
            Float8Rows(
                self.layout, self.dtype, fp8_slots, shapes=[p.shape for p in params], group=group, device=self.device
            )
            if fp8_slots and world_size > 1 and self.quantized is None
            else None
        )
        """How the hooks' gathers carry float8 layers' weights (see [Note: float8 gather rows]), or None."""
        self.exposed = False
        """Gathered for user code (GatheredParameters, generation), which may keep aliases; see `release`."""
        self.records: list[ParamRecord] = []
        self.splits_reduce = any_reduce_dtype(params)  # torch_autocast: a reduce-scatter per dtype (dtype_split.py)
        self._shard_params(spec)
        if not self.persistent:
            self._free_storage()
        self.store.release(self.shard, dirty=True)

    def _shard_params(self, spec: UnitSpec) -> None:
        """Copy this rank's slice of each parameter into the shard (zero padding after it), point the parameter
        at its place in the full buffer (filled for a persistent unit), and record it as sharded."""
        with torch.no_grad(), internal_access():
            for index, ((name, param), offset) in enumerate(zip(spec.params, self.layout.full_offsets)):
                numel, piece, start = param.numel(), self.layout.shard_numels[index], self.layout.shard_offsets[index]
                flat = param.data.reshape(-1)
                lo, hi = min(numel, self.rank * piece), min(numel, (self.rank + 1) * piece)
                self.shard[start : start + hi - lo].copy_(flat[lo:hi])
                self.shard[start + hi - lo : start + piece].zero_()
                if self.persistent:
                    self.full[offset : offset + numel].copy_(flat)
                param.data = self.full[offset : offset + numel].view(param.shape)
                record = ParamRecord(
                    name=name,
                    shape=param.shape,
                    numel=numel,
                    unit=self,
                    index=index,
                    shard_offset=start,
                    shard_numel=piece,
                    full_offset=offset,
                    persistent=spec.persistent,
                )
                self.records.append(record)
                make_sharded(param, record)

    # ---- gather ----
    def _rows(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer.view(self.world_size, self.layout.shard_numel + 1)

    def _keep_own_slices(self) -> None:
        """Copy this rank's slice of every parameter from the full buffer into the shard."""
        for offset, piece, start in zip(self.layout.full_offsets, self.layout.shard_numels, self.layout.shard_offsets):
            self.shard[start : start + piece].copy_(
                self.full[offset + self.rank * piece : offset + (self.rank + 1) * piece]
            )

    def start_gather(self, *, hook: bool = False) -> None:
        """Launch the all-gather (asynchronous); `finish_gather` completes it. `hook`: for the module hooks
        (forward, backward, prefetch), which travel quantized when `self.quantized` says so; every other gather
        (GatheredParameters, persistent refresh, checkpoints) is exact."""
        if self.status is not ZeroParamStatus.NOT_AVAILABLE:
            return
        self.status = ZeroParamStatus.INFLIGHT
        if self.float8 is not None:
            self.float8.drop()  # a float8 weight is valid only for the gather that filled it
        if self.world_size == 1 or not self.params:
            self._pending = None
            return
        if hook and self.secondary is not None and self.secondary.filled:  # see [Note: hpZ secondary shard]
            with self._launching():
                work, buffer = self.secondary.start_gather(self.pool, self.tag)
            self._pending = (work, buffer, self.secondary)
            return
        codec = (self.quantized or self.float8) if hook else None
        if codec is None:
            buffer = self.pool.take(self.world_size * (self.layout.shard_numel + 1), self.dtype)
            own = self._rows(buffer)[self.rank]
        else:
            buffer = self.pool.take(self.world_size * codec.row_bytes, torch.int8)
            own = buffer.view(self.world_size, codec.row_bytes)[self.rank]
        self.store.fetch(self.shard)
        if codec is None:
            own[:-1].copy_(self.shard, non_blocking=True)
            own[-1] = self.tag
        else:
            scratch = self.pool.take(codec.padded, torch.float32)
            codec.encode(self.shard, own, self.tag, scratch)
            self.pool.give(scratch)
        self.store.release(self.shard, dirty=False)
        with self._launching():
            gather = (
                collectives.all_gather(buffer, own, group=self.group, async_op=True)
                if self.hierarchical is None
                else self.hierarchical.launch(buffer, own)
            )
        self._pending = (gather, buffer, codec)

    def _launching(self) -> contextlib.AbstractContextManager[None]:
        """Around a gather's launch: on the communication stream, after the current stream's work so far (the
        pooled buffer's earlier readers, this rank's row), where there is one."""
        return contextlib.nullcontext() if self.comm is None else self.comm.launching()

    def finish_gather(self, *, hook: bool = False) -> None:
        if self.status is ZeroParamStatus.NOT_AVAILABLE:
            self.start_gather(hook=hook)
        if self.status is not ZeroParamStatus.INFLIGHT:
            return
        self._grow_storage()
        with torch.no_grad():
            if self._pending is None:  # one rank: the shard is the whole parameter (plus padding)
                self.store.fetch(self.shard)
                self.full.copy_(self.shard, non_blocking=True)
                self.store.release(self.shard, dirty=False)
            else:
                work, buffer, codec = self._pending
                if self.comm is not None:  # before the buffer is read here or handed back to the pool
                    self.comm.join()
                work.wait()
                self._unpack(buffer, codec)
                if self.secondary is not None and codec is not self.secondary:
                    self.secondary.keep(self.full)
        self._pending = None
        self.status = ZeroParamStatus.AVAILABLE

    def _unpack(self, buffer: torch.Tensor, codec: QuantizedRows | Float8Rows | SecondaryShard | None) -> None:
        """Each parameter's rows of a completed gather into the full buffer (dequantized first with `codec`)."""
        scratch = None
        if isinstance(codec, SecondaryShard):
            self._check_tags(codec.unpack(buffer, self.full))
            self.pool.give(buffer)
            return
        if isinstance(codec, Float8Rows):
            rows = buffer.view(self.world_size, codec.row_bytes)
            self._check_tags(codec.tags(rows))
            codec.decode(rows, self.full)
            self.pool.give(buffer)
            return
        if codec is None:
            rows = self._rows(buffer)
            tags, values = rows[:, -1], rows[:, :-1]
        else:
            rows = buffer.view(self.world_size, codec.row_bytes)
            scratch = self.pool.take(self.world_size * codec.padded, torch.float32)
            tags, values = codec.tags(rows), codec.decode(rows, scratch)
        self._check_tags(tags)
        for offset, piece, start in zip(self.layout.full_offsets, self.layout.shard_numels, self.layout.shard_offsets):
            self.full[offset : offset + piece * self.world_size].view(self.world_size, piece).copy_(
                values[:, start : start + piece]
            )
        self.pool.give(buffer)
        if scratch is not None:
            self.pool.give(scratch)

    def _check_tags(self, tags: torch.Tensor) -> None:
        if tags.device.type != "cpu":  # checking now would stall the device stream: check at the step
            self.manager.defer_tag_check(tags, self.tag, self.name)
        else:
            self.manager.check_tags(tags, self.tag, self.name)

    # ---- release ----
    def release(self) -> None:
        """Free the gathered values (persistent units stay gathered). See [Note: aliases of gathered values]."""
        if self.persistent or self.status is ZeroParamStatus.NOT_AVAILABLE:
            return
        if self.status is ZeroParamStatus.INFLIGHT:
            self.finish_gather()
        if self.exposed and self._aliased():
            self._fresh_storage()
        self.exposed = False
        self._free_storage()
        self.status = ZeroParamStatus.NOT_AVAILABLE

    def discard(self) -> None:
        """Drop this unit for good (zero.Init's units, once the engine's units hold their values): free the
        gathered values and the shard, and the shard's file with NVMe offload."""
        self.persistent = False
        self.release()
        self.pool.drop_idle()  # a dropped unit's pool keeps no idle memory: its units are gathered once more, at most
        self.store.discard(self.shard)
        self.shard = self.shard.new_empty(0)

    def _aliased(self) -> bool:
        """Whether tensors besides the unit's buffer and its parameters share the gathered storage."""
        count = storage_use_count(self.full)
        if count is None:  # cannot tell: keep the values alive, at the cost of one allocation
            return True
        return count > len(self.params) + 1  # the parameters and self.full

    def _fresh_storage(self) -> None:
        """Leave the gathered storage to its aliases (it is freed when the last of them dies) and point the
        unit's buffer and parameters at a new one, which `_free_storage` empties and the next gather fills."""
        if self._lent is not None:  # the lent memory stays with the aliases
            self.pool.forget(self._lent)
            self._lent = None
        fresh = torch.empty(self.layout.full_numel, dtype=self.dtype, device=self.device)
        with torch.no_grad(), internal_access():
            for param, record in zip(self.params, self.records):
                param.data = fresh[record.full_offset : record.full_offset + record.numel].view(record.shape)
        self.full = fresh

    def _free_storage(self) -> None:
        if self.float8 is not None:
            self.float8.drop()
        if self._lent is not None:
            self.pool.reclaim(self.full, self._lent)
            self._lent = None
        else:
            self.full.untyped_storage().resize_(0)
        self.status = ZeroParamStatus.NOT_AVAILABLE

    def _grow_storage(self) -> None:
        if self.full.untyped_storage().nbytes() != self.full_bytes:
            self._lent = self.pool.lend(self.full)

    @property
    def holds_lent_memory(self) -> bool:
        """The gathered values are in memory the pool lent (counted by the pool, not by the unit)."""
        return self._lent is not None

    def refresh_persistent(self) -> None:
        """After a step: the persistent unit gathers its updated shards again."""
        if not self.persistent:
            return
        self.status = ZeroParamStatus.NOT_AVAILABLE
        self.start_gather()
        self.finish_gather()

    def write_full_into_shard(self) -> None:
        """After the full values were changed in place (GatheredParameters): keep this rank's slices."""
        if self.secondary is not None:
            self.secondary.filled = False
        with torch.no_grad():
            self.store.fetch(self.shard)
            self._keep_own_slices()
            self.store.release(self.shard, dirty=True)

    # ---- gradients ----
    def reduce_gradients(
        self,
        grads: dict[int, torch.Tensor],
        trainable: list[int],
        staging: torch.Tensor,
        receive: torch.Tensor,
        shard_offsets: list[int],
        *,
        scale: float = 1.0,
    ) -> Any:
        """Pack `grads` (by parameter index) into the staging rows and launch the reduce-scatter into `receive`.

        `trainable` lists the parameter indices that take part, `shard_offsets` their offsets in `receive`.
        `scale` multiplies the packed rows, in the communication dtype, before the reduction (prescale_gradients
        and gradient_predivide_factor). Returns the collective handle (None on one rank, where `receive` is
        filled directly).
        """
        parts = dtype_parts(self, trainable, shard_offsets, staging.dtype) if self.splits_reduce else None
        if parts is not None:  # torch_autocast's safe modules: a reduce-scatter per dtype, each back through here
            return launch_parts(self, parts, grads, staging, receive, scale=scale)
        width = receive.numel()
        rows = staging.view(self.world_size, width)
        with torch.no_grad():  # every column of `rows` belongs to one trainable parameter: each is written once
            for index, start in zip(trainable, shard_offsets):
                grad = grads.get(index)
                piece = self.layout.shard_numels[index]
                columns = rows[:, start : start + piece]
                if grad is None:
                    columns.zero_()
                    continue
                flat = grad.reshape(-1)
                whole = flat.numel() // piece if piece else 0
                if whole:
                    columns[:whole].copy_(flat[: whole * piece].view(whole, piece))
                rest = flat.numel() - whole * piece
                if rest:
                    columns[whole, :rest].copy_(flat[whole * piece :])
                    columns[whole, rest:].zero_()
                    whole += 1
                if whole < self.world_size:
                    columns[whole:].zero_()  # the padding of the last rows
            if scale != 1.0:
                staging.mul_(scale)
        if self.world_size == 1:
            receive.copy_(rows[0])
            return None
        if self.quantized_reduce is not None:
            return self.quantized_reduce.launch(receive, staging)
        return collectives.reduce_scatter(receive, staging, group=self.group, async_op=True, input_is_scratch=True)


def host_or_device_allocator(pin: bool) -> Callable[[int, torch.dtype, torch.device], torch.Tensor]:
    """Allocate shards; on the host (parameter offload) pinned when asked, through the offload policy's pool
    (pageable, with a warning, once pinning would take more than half of the host's available memory)."""
    host = CPUOffload(pin_memory=pin)

    def allocate(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if device.type == "cpu":
            return host.allocate(numel, dtype, device)
        return torch.zeros(numel, dtype=dtype, device=device)

    return allocate

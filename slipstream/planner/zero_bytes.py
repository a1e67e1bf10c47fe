"""Bytes of the tensors the ZeRO engine holds, by role, derived from the engine's own layout rules (pure).

Stages 0-2 mirror `zero/flat_group.py` on the layout of `zero/layout.py` ([Note: bucket-major layout]):
- params: the flat buffer, `flat_numel` elements (every bucket padded to a multiple of the world) in the
  parameter dtype;
- master: none when the master dtype is the parameter dtype and nothing is offloaded (the master pieces are
  views of the flat params); else `owned` fp32 elements (owned = flat_numel at stage 0, shard_numel above),
  on the host with optimizer offload;
- grads: `flat_numel` (stages 0, 1) or `owned` (stage 2) elements in the grad-accumulation dtype, on the device;
- host_buffers (offload): `owned` fp32 gradient copies (none when the device is the host and the gradients are
  fp32: the optimizer reads them in place), plus `owned` elements in the parameter dtype when that is not fp32
  (the CPU Adam op's low-precision output);
- optimizer_state: states-per-element (AdamW: exp_avg, exp_avg_sq) x `owned` elements in the optimizer state
  dtype (fp32, or bf16 with `bf16_optimizer_states`);
- comm_buffers (stage 2, `zero/stage2.py`): two staging buffers of world x chunk and two receive buffers of
  chunk elements, in the grad-accumulation dtype, where the layout's buckets and the chunk are bounded by
  `STAGE2_STAGING_BYTES` ([Note: stage-2 staging bound] in zero/layout.py);
- the compressed all-reduce of the 1-bit optimizers (`compressed_allreduce_bytes`; see [Note: compressed
  all-reduce bytes]), at stages 0 and 1 without offload, in optimizer_state and comm_buffers;
Stage 3 mirrors `zero/stage3/`: each parameter contributes ceil(numel / world) elements to its unit's shard
(`units.shard_layout`); master/grads/host buffers/optimizer state cover the trainable shard elements; the
reduce-scatter keeps two staging buffers of world x (largest unit's trainable shard) and two receive buffers
of that shard; the gather pool's buffers (world x (unit shard + 1) elements each), the gathered units' peak and
the gradients waiting for the reduce-scatter order come from `prefetch.simulate_pool`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from slipstream.config.optimizers import compresses, states_per_element
from slipstream.planner.comm_model import QUANT_BLOCK
from slipstream.planner.prefetch import PoolFigures, UnitShape, simulate_pool
from slipstream.planner.reduce_buffers import split_pool_bytes, stage2_ring_bytes, step_reducer_bytes
from slipstream.planner.types import DTYPE_BYTES, Settings
from slipstream.zero.layout import GroupLayout, build_layout, stage2_bucket_numel

# [Note: compressed all-reduce bytes]
# 1-bit Adam, 0/1 Adam and 1-bit LAMB, once compression starts, hold one `OneBitAllReduce` per slot
# (comm/compressed/onebit.py): at stage 0 a slot is one of the optimizer's pieces (a whole padded bucket), at
# stage 1 on several ranks a bucket's gradients (1-bit Adam only). A slot of n elements in a dtype of d bytes is
# padded to p = n rounded up to a multiple of 8 x world, served in chunks of c = p / world, sent as packed rows of
# r = c / 8 + 4 bytes (the signs, then a float32 scale). Per slot:
#     optimizer_state: (p + c) x d            the worker and the server error (checkpoints keep them)
#     comm_buffers:    c x d + (3 world + 1) r  the served chunk's values; the sent, received and gathered rows
#                                             (world rows each) and the served row
# plus one shared Scratch, sized for the largest slot's s = p, in comm_buffers:
#     s x 2 d (staging, values) + s (sign bits) + s (packed int64 words) + s / 2 (int32 codes) + 2 x 2048 x d
#     (the 256 x 8 sign table and its scaled copy).
# The dtype is the pieces' (the master dtype) at stage 0, the gradient-accumulation dtype at stage 1.
_SIGN_TABLE_NUMEL = 256 * 8
_SCALE_BYTES = 4


def optimizer_states_per_element(name: str, params: Sequence[tuple[str, object]] = ()) -> float:
    """Full-size state tensors the optimizer keeps per master element (scalars such as `step` excluded), from
    the optimizer registry (config/optimizers.py)."""
    return states_per_element(name, dict(params))


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ZeroBytes:
    """Per-rank bytes by role of one stage/offload combination (see [Note: planner roles] in types.py)."""

    device: dict[str, int]
    host: dict[str, int]
    owned: dict[str, int]
    """In the keys of `engine.optimizer.owned_bytes()`."""
    pinned_blocks: tuple[int, ...]
    """Sizes of the host blocks that are pinned (one allocation each), for the pinned-allocator rounding."""


def compressed_allreduce_bytes(slots: Sequence[int], *, world: int, dtype_bytes: int) -> dict[str, int]:
    """The 1-bit compressed all-reduces of slots with these element counts, in the keys of `owned_bytes()`
    (see [Note: compressed all-reduce bytes])."""
    if not slots:
        return {"optimizer_state": 0, "comm_buffers": 0}
    padded = [-(-numel // (8 * world)) * 8 * world for numel in slots]
    errors = buffers = 0
    for numel in padded:
        chunk = numel // world
        errors += (numel + chunk) * dtype_bytes
        buffers += chunk * dtype_bytes + (3 * world + 1) * (chunk // 8 + _SCALE_BYTES)
    largest = max(padded)
    scratch = largest * 2 * dtype_bytes + largest * 2 + largest // 2 + 2 * _SIGN_TABLE_NUMEL * dtype_bytes
    return {"optimizer_state": errors, "comm_buffers": buffers + scratch}


def _compression_roles(layout: GroupLayout, *, stage: int, settings: Settings, offload: bool) -> dict[str, int]:
    """What the 1-bit optimizers' compressed all-reduce adds at stages 0 and 1 (none for other optimizers, and
    with offload, which they do not run with)."""
    if not compresses(settings.optimizer) or stage not in (0, 1) or offload:
        return {}
    world = layout.world_size
    dtype = settings.grad_accum_dtype if stage == 1 and world > 1 else settings.master_dtype
    slots = [b.padded_numel for b in layout.buckets]
    return compressed_allreduce_bytes(slots, world=world, dtype_bytes=DTYPE_BYTES[dtype])


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def pinned_rounding(blocks: Sequence[int]) -> int:
    """Bytes the CUDA caching host allocator adds by rounding each pinned block up to a power of two."""
    return sum(_next_pow2(b) - b for b in blocks if b > 0)


def _optimizer_roles(owned: int, *, settings: Settings, offload: bool, aliased: bool) -> dict[str, int]:
    """master, optimizer_state, host_buffers for `owned` master elements (identical at every stage)."""
    param, master = DTYPE_BYTES[settings.dtype], DTYPE_BYTES[settings.master_dtype]
    states = optimizer_states_per_element(settings.optimizer, settings.optimizer_params)
    state_bytes = (
        DTYPE_BYTES[settings.optimizer_state_dtype]
        if settings.optimizer_state_dtype
        else (param if aliased else master)
    )
    grads_in_place = settings.device_is_host and settings.grad_accum_dtype == settings.master_dtype
    host_buffers = (
        ((0 if grads_in_place else owned * master) + (owned * param if settings.dtype != settings.master_dtype else 0))
        if offload
        else 0
    )
    return {
        "master": 0 if aliased else owned * master,
        "optimizer_state": round(states * owned) * state_bytes,
        "host_buffers": host_buffers,
    }


def _place(
    owned: dict[str, int], *, offload: bool, device_extra: dict[str, int]
) -> tuple[dict[str, int], dict[str, int]]:
    device = {
        "params": owned["params"],
        "grads": owned["grads"],
        "comm_buffers": owned["comm_buffers"],
        "master": 0 if offload else owned["master"],
        "optimizer_state": 0 if offload else owned["optimizer_state"],
        **device_extra,
    }
    host = {
        "master": owned["master"] if offload else 0,
        "optimizer_state": owned["optimizer_state"] if offload else 0,
        "host_buffers": owned["host_buffers"],
        "offloaded_params": 0,
        "pinned_rounding": 0,
    }
    return device, host


def stage012_bytes(
    trainable: Sequence[int],
    frozen: int,
    *,
    stage: int,
    world: int,
    settings: Settings,
    offload: bool,
    reduce_dtypes: Sequence[str | None] | None = None,
) -> ZeroBytes:
    """Stages 0-2 for one param group whose trainable parameters have these element counts (registration
    order); `frozen` is the element count of the parameters without gradients; `reduce_dtypes` (per trainable
    parameter, None: the ZeRO reduce dtype) as torch_autocast's safe modules mark them."""
    param, grad = DTYPE_BYTES[settings.dtype], DTYPE_BYTES[settings.grad_accum_dtype]
    if not trainable:
        zero = dict.fromkeys(("params", "master", "grads", "optimizer_state", "host_buffers", "comm_buffers"), 0)
        device, host = _place(
            zero, offload=offload, device_extra={"frozen_params": frozen * param, "gathered_params": 0, "transient": 0}
        )
        return ZeroBytes(device=device, host=host, owned=zero, pinned_blocks=())
    bucket_numel = settings.reduce_bucket_size if stage != 2 else stage2_bucket_numel(settings.reduce_bucket_size, grad)
    layout = build_layout(list(trainable), world_size=world, bucket_numel=bucket_numel, reduce_dtypes=reduce_dtypes)
    owned_numel = layout.flat_numel if stage == 0 else layout.shard_numel
    aliased = settings.dtype == settings.master_dtype and not offload
    owned = {
        "params": layout.flat_numel * param,
        "grads": (layout.flat_numel if stage in (0, 1) else owned_numel) * grad,
        "comm_buffers": 0,
        **_optimizer_roles(owned_numel, settings=settings, offload=offload, aliased=aliased),
    }
    if stage == 2:
        owned["comm_buffers"] = stage2_ring_bytes(layout, reduce_dtype=settings.comm_dtype, grad_bytes=grad)
    else:
        owned["comm_buffers"] = step_reducer_bytes(
            layout, reduce_dtype=settings.comm_dtype, storage_dtype=settings.grad_accum_dtype
        )
    for role, value in _compression_roles(layout, stage=stage, settings=settings, offload=offload).items():
        owned[role] += value
    # autograd's gradient of the largest parameter; at stage 2 also a bucket's gradients waiting for the rest of it
    waiting = max(b.numel for b in layout.buckets) if stage == 2 else 0
    extra = {"frozen_params": frozen * param, "gathered_params": 0, "transient": max(max(trainable), waiting) * param}
    device, host = _place(owned, offload=offload, device_extra=extra)
    blocks: tuple[int, ...] = ()
    if offload:
        blocks = (owned_numel * DTYPE_BYTES[settings.master_dtype],) * 2
        if settings.dtype != settings.master_dtype:
            blocks += (owned_numel * param,)
    return ZeroBytes(device=device, host=host, owned=owned, pinned_blocks=blocks)


def secondary_shard_numel(units: Sequence[UnitShape], shard_numels: Sequence[int], *, world: int, size: int) -> int:
    """Elements of hpZ's secondary shards on one rank: world * shard / size per unit the hooks gather over the
    whole group (none when `size` is 1 or the whole group; the persistent unit stays gathered)."""
    if size <= 1 or size >= world:
        return 0
    return sum(world * shard // size for u, shard in zip(units, shard_numels) if u.hooked and not u.persistent)


def loco_kept_bytes(
    units: Sequence[UnitShape], *, world: int, settings: Settings, ranks_per_node: int | None = None
) -> int:
    """Bytes of ZeRO++ LoCo's kept errors on one rank (zero/stage3/loco.py), int8 rows with a 4-byte scale per block
    of 256, per unit with trainable parameters (W of them per rank): phase 1's n pieces of b x W, phase 2's b pieces
    of W, on a group of n = a x b ranks (a per node, `ranks_per_node`; None: one node). 0 without LoCo."""
    if settings.stage3.loco is None or not settings.stage3.quantized_gradients or world <= 1:
        return 0
    a = min(ranks_per_node or world, world)
    b = world // a

    def rows(count: int, numel: int) -> int:
        blocks = -(-numel // QUANT_BLOCK)
        return count * (blocks * QUANT_BLOCK + 4 * blocks)

    total = 0
    for unit in units:
        width = sum(-(-n // world) for n, t in zip(unit.numels, unit.trainable) if t)
        if width:
            total += (rows(a, b * width) if a > 1 else 0) + (rows(b, width) if b > 1 else 0)
    return total


def stage3_bytes(
    units: Sequence[UnitShape],
    *,
    world: int,
    settings: Settings,
    offload: bool,
    offload_param: bool,
    nvme_params: bool = False,
) -> tuple[ZeroBytes, PoolFigures]:
    """Stage 3 for the units of `prefetch.UnitShape` (in the engine's unit order); `nvme_params`: the shards
    live in files (offload_param.device nvme). MiCS shards each unit over `mics_shard_size` ranks; hpZ adds each
    hooked unit's secondary shard, 1/h of its gathered buffer (zero/stage3/secondary.py), to the device params."""
    param, grad = DTYPE_BYTES[settings.dtype], DTYPE_BYTES[settings.grad_accum_dtype]
    world = settings.stage3.shard_size or world
    shard_numels = [sum(-(-n // world) for n in u.numels) for u in units]
    trainable_shard = [sum(-(-n // world) for n, t in zip(u.numels, u.trainable) if t) for u in units]
    total_trainable = sum(trainable_shard)
    # the masters are views of the shards when both are the same dtype in the same memory (zero/stage3/optimizer.py)
    aliased = settings.dtype == settings.master_dtype and (not offload or (settings.device_is_host and not nvme_params))
    pool = simulate_pool(
        units,
        world=world,
        dtype_bytes=param,
        prefetch_numel=settings.stage3.prefetch_numel,
        max_live_numel=settings.stage3.max_live_numel,
    )
    largest = max(trainable_shard, default=0)
    staging = 2 * largest * world * grad + 2 * largest * grad if total_trainable else 0
    staging += split_pool_bytes(units, world=world, reduce_dtype=settings.comm_dtype, overlap=settings.overlap_comm)
    staging += loco_kept_bytes(units, world=world, settings=settings)
    shards = sum(shard_numels) * param
    secondary = secondary_shard_numel(units, shard_numels, world=world, size=settings.stage3.secondary_shard_size)
    owned = {
        "params": shards + secondary * param,
        "grads": total_trainable * grad,
        "comm_buffers": staging + pool.pool_bytes,
        **_optimizer_roles(total_trainable, settings=settings, offload=offload, aliased=aliased),
    }
    extra = {"frozen_params": 0, "gathered_params": pool.gathered_peak_bytes, "transient": pool.held_grads_peak_bytes}
    device, host = _place(owned, offload=offload, device_extra=extra)
    blocks: list[int] = []
    if offload and total_trainable:
        grads_in_place = settings.device_is_host and settings.grad_accum_dtype == settings.master_dtype
        blocks += [total_trainable * DTYPE_BYTES[settings.master_dtype]] * ((not aliased) + (not grads_in_place))
        if settings.dtype != settings.master_dtype:
            blocks.append(total_trainable * param)
    if offload_param:
        device["params"] = secondary * param  # the secondary shards stay on the device
        host["offloaded_params"] = shards
        if aliased and not offload:  # fp32 without optimizer offload: the masters are the host shards, and so
            # is the state (with optimizer offload it is on the host already)
            host["optimizer_state"], device["optimizer_state"] = device["optimizer_state"], 0
        blocks += [s * param for s in shard_numels if s]
    owned["offloaded_params"] = shards if offload_param else 0
    return ZeroBytes(device=device, host=host, owned=owned, pinned_blocks=tuple(blocks)), pool

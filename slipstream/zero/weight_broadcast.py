"""`broadcast_full_weights` / `receive_full_weights`: the whole weights handed from training to a generator process.

A post-training loop that generates in another process (vLLM, SGLang, a plain model) needs the trained
weights there after each update. The training ranks all call `broadcast_full_weights(engine, group, ...)`
(collective at ZeRO-3: `iter_full_weights` gathers the units a bucket at a time); the rank that is rank `src`
of `group` sends, the generator processes (the other members of `group`) call `receive_full_weights(group,
src=...)` and get `(name, tensor)` for every parameter. Training ranks outside the group pass `group=None`.

`group` is any `torch.distributed.ProcessGroup` holding the sender and the generators, by its own ranks: one
from `slipstream.comm.new_group(ranks)` when the generators are in the training world, or one built on a store
shared with processes outside it (`torch.distributed.ProcessGroupGloo(store, rank, size)`, or NCCL's on GPUs).
The collectives are the group's own `broadcast`, so the group need not belong to the default world.

The values travel in buckets: each bucket packs whole tensors (as bytes, each at a 16-byte aligned offset) into
one flat buffer of `bucket_bytes`, allocated once and reused, and costs three broadcasts (the header's length,
the header: names, dtypes, shapes, offsets as JSON; the bytes). A tensor larger than the buffer travels alone. The
receiver's buffer is allocated once too (grown only for such a tensor); the tensors it yields are copies.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from slipstream.zero.full_weights import DEFAULT_BUCKET_BYTES, iter_full_weights
from slipstream.zero.stage3.model import ZeroModel

_ALIGN = 16
Entry = tuple[str, str, tuple[int, ...], int]  # name, dtype name, shape, byte offset in the bucket


class HandOffGroup(Protocol):
    """A process group (`torch.distributed.ProcessGroup`, or a backend such as `ProcessGroupGloo` built on a
    store): its own rank and its own broadcast."""

    def rank(self) -> int: ...

    def broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions) -> dist.Work: ...


class TrainingEngine(Protocol):
    """What is read of the engine: its model and, at ZeRO-3, its ZeroModel."""

    module: nn.Module
    zero_model: ZeroModel | None


def _broadcast(group: HandOffGroup, src: int, tensor: torch.Tensor) -> None:
    options = dist.BroadcastOptions()  # the group's own broadcast: it need not belong to the default world
    options.rootRank = src
    group.broadcast([tensor], options).wait()


def _send_bucket(group: HandOffGroup, src: int, entries: list[Entry] | None, data: torch.Tensor) -> None:
    header = torch.frombuffer(bytearray(json.dumps(entries).encode()), dtype=torch.uint8)
    _broadcast(group, src, torch.tensor([header.numel(), data.numel()], dtype=torch.int64))
    _broadcast(group, src, header)
    if data.numel():
        _broadcast(group, src, data)


def broadcast_full_weights(
    engine: TrainingEngine, group: HandOffGroup | None, *, src: int = 0, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> int:
    """Every parameter of `engine`'s model, whole, from rank `src` of `group` to the group's other members, in
    buckets of at most `bucket_bytes`. Every training rank calls it (`group=None` outside the group); returns the
    number of buckets sent (0 where nothing was sent)."""
    if bucket_bytes <= 0:
        raise ValueError(f"broadcast_full_weights(bucket_bytes={bucket_bytes}): give a positive number of bytes")
    if group is not None and group.rank() != src:
        raise ValueError(
            f"broadcast_full_weights: this training rank is rank {group.rank()} of the group, not src={src}; the "
            "group holds the sending rank and the generator processes only: pass group=None on the other "
            "training ranks (they still call it, for the gathers)"
        )
    weights = iter_full_weights(engine.module, engine.zero_model, bucket_bytes=bucket_bytes)
    if group is None:
        for _ in weights:  # the gathers are collective: this rank takes part and sends nothing
            pass
        return 0
    return _send_all(weights, group, src, bucket_bytes)


def _send_all(weights: Iterator[tuple[str, torch.Tensor]], group: HandOffGroup, src: int, bucket_bytes: int) -> int:
    buffer = torch.empty(bucket_bytes, dtype=torch.uint8)  # one buffer, reused for every bucket
    entries: list[Entry] = []
    used = buckets = 0
    for name, value in weights:
        raw = value.detach().contiguous().reshape(-1).view(torch.uint8)
        if entries and used + raw.numel() > bucket_bytes:
            _send_bucket(group, src, entries, buffer[:used])
            entries, used, buckets = [], 0, buckets + 1
        entry = (name, str(value.dtype).removeprefix("torch."), tuple(value.shape), used)
        if raw.numel() > bucket_bytes:  # alone, without the buffer
            _send_bucket(group, src, [(*entry[:3], 0)], raw)
            buckets += 1
            continue
        buffer[used : used + raw.numel()].copy_(raw)
        entries.append(entry)
        used += -(-raw.numel() // _ALIGN) * _ALIGN
    if entries:
        _send_bucket(group, src, entries, buffer[:used])
        buckets += 1
    _send_bucket(group, src, None, buffer[:0])  # the end
    return buckets


def receive_full_weights(group: HandOffGroup, *, src: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor) of every parameter `broadcast_full_weights` sends from rank `src` of `group`."""
    if group.rank() == src:
        raise ValueError(
            f"receive_full_weights(src={src}): this process is rank {src} of the group, the sender; "
            "call broadcast_full_weights there"
        )
    buffer = torch.empty(0, dtype=torch.uint8)
    sizes = torch.empty(2, dtype=torch.int64)
    while True:
        _broadcast(group, src, sizes)
        header = torch.empty(int(sizes[0]), dtype=torch.uint8)
        _broadcast(group, src, header)
        entries: list[Entry] | None = json.loads(header.numpy().tobytes())
        if entries is None:
            return
        if buffer.numel() < int(sizes[1]):
            buffer = torch.empty(int(sizes[1]), dtype=torch.uint8)
        data = buffer[: int(sizes[1])]
        _broadcast(group, src, data)
        for name, dtype, shape, offset in entries:
            kind = getattr(torch, dtype)
            count = int(torch.Size(shape).numel()) * torch.empty(0, dtype=kind).element_size()
            yield name, data[offset : offset + count].view(kind).reshape(shape).clone()

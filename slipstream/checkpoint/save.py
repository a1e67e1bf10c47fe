"""`save_engine`: every rank writes its slices into one safetensors file; rank 0 writes the manifest and commits.

[Note: checkpoint save]
1. All ranks check they were given the same tag (`checkpoint.tag_validation`: WARN, IGNORE or FAIL).
2. Rank 0 creates `save_dir/.tmp-<tag>/` (removing a stale one); barrier. A rank that never called
   save makes the others raise within the collective timeout, naming the missing ranks.
3. Rank r writes `rank_<r>.safetensors` (its parameter slices -- fp32 masters where they exist --,
   optimizer-state slices, its RNG states; rank 0 also buffers and client tensors) and a small
   `rank_<r>.json` listing its pieces and the file's sha256, fsynced; barrier.
4. Rank 0 merges the rank lists into `manifest.json` (global shapes, pieces, sha256 per file, scalars),
   checks that the pieces cover every tensor, renames the directory into place (atomic.commit_dir) and
   only then replaces `latest`; barrier. A crash at any point leaves the previous checkpoint and `latest`
   untouched (atomic.recover tidies up what a crash left).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from slipstream.checkpoint.atomic import (
    check_tag,
    commit_dir,
    fsync_file,
    make_tmp_dir,
    tmp_dir_for,
    write_latest,
)
from slipstream.checkpoint.errors import CheckpointError
from slipstream.checkpoint.manifest import (
    FORMAT_VERSION,
    Manifest,
    Piece,
    TensorEntry,
    check_coverage,
    dtype_name,
    write_manifest,
)
from slipstream.checkpoint.safetensors_io import SafetensorsWriter
from slipstream.checkpoint.state import (
    EngineParts,
    collect_slices,
    flat_state_keys,
    rng_tensors,
    trainable_names,
)
from slipstream.comm import collectives
from slipstream.comm.collectives import CollectiveError
from slipstream.utils.logging import warn_once

_Item = tuple[str, torch.Tensor, int, int, tuple[int, ...], bool]  # key, data, start, end, global shape, frozen


def validate_tag(tag: str, mode: str, *, world_size: int) -> None:
    if world_size == 1 or mode.upper() == "IGNORE":
        return
    digest = int.from_bytes(hashlib.sha256(tag.encode()).digest()[:7], "little")
    tags = torch.zeros(world_size, dtype=torch.int64)
    mine = torch.tensor([digest], dtype=torch.int64)
    _barrier_call(lambda: collectives.all_gather(tags, mine), "save_checkpoint (tag check)")
    if len(set(tags.tolist())) > 1:
        message = (f"save_checkpoint: the ranks passed different tags (this rank: {tag!r}); pass the same tag on "
                   "every rank (or none: the default global_step<N> is the same everywhere)")
        if mode.upper() == "FAIL":
            raise CheckpointError(message)
        warn_once(f"tag-mismatch:{tag}", "slipstream: " + message)


def _barrier_call(call: Any, what: str) -> None:
    try:
        call()
    except CollectiveError as exc:
        raise CheckpointError(f"{what}: {exc.summary()}. Every rank must call {what.split()[0]}, with the same "
                              "arguments") from exc


def _items(parts: EngineParts, client_tensors: dict[str, torch.Tensor], exclude_frozen: bool) -> list[_Item]:
    items: list[_Item] = []
    trainable = trainable_names(parts)
    for piece in collect_slices(parts, for_save=True):
        frozen = piece.name not in trainable
        if frozen and exclude_frozen:
            continue
        source = piece.master if piece.master is not None else piece.value
        items.append((f"module/{piece.name}", source, piece.lo, piece.hi, piece.shape, frozen))
        if piece.piece is not None and parts.optimizer is not None:
            state = parts.optimizer.optimizer.state.get(piece.piece, {})
            for key in flat_state_keys(parts.optimizer, piece.piece):
                items.append((f"optimizer/{piece.name}/{key}", piece.state_view(state, key), piece.lo, piece.hi,
                              piece.shape, False))
    for name, tensor in rng_tensors().items():
        items.append((f"rng/{parts.rank}/{name}", tensor, 0, tensor.numel(), (tensor.numel(),), False))
    if parts.rank == 0:
        for name, buffer in parts.module.named_buffers():
            items.append((f"buffer/{name}", buffer.detach(), 0, buffer.numel(), tuple(buffer.shape), False))
        for key, tensor in client_tensors.items():
            items.append((f"client/{key}", tensor, 0, tensor.numel(), tuple(tensor.shape), False))
    return items


def save_engine(parts: EngineParts, save_dir: str, tag: str, *, scalars: dict[str, Any],
                client_tensors: dict[str, torch.Tensor], save_latest: bool, exclude_frozen: bool,
                tag_validation: str, version: str) -> Path:
    check_tag(tag)
    validate_tag(tag, tag_validation, world_size=parts.world_size)
    root = Path(save_dir)
    if parts.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        make_tmp_dir(root, tag)
    _barrier_call(collectives.barrier, "save_checkpoint")
    tmp = tmp_dir_for(root, tag)
    name = f"rank_{parts.rank:05d}.safetensors"
    items = _items(parts, client_tensors, exclude_frozen)
    entries: list[tuple[str, torch.dtype, tuple[int, ...]]] = [(key, data.dtype, (end - start,))
                                                               for key, data, start, end, _, _ in items]
    with SafetensorsWriter(tmp / name, entries) as writer:
        for key, data, *_ in items:
            writer.write(key, data.detach().reshape(-1).to("cpu"))
        digest = writer.close()
        size = writer.bytes_written
    listing = {"file": name, "sha256": digest, "bytes": size,
               "pieces": [[key, start, end, list(shape), dtype_name(data.dtype), frozen]
                          for key, data, start, end, shape, frozen in items]}
    (tmp / f"rank_{parts.rank:05d}.json").write_text(json.dumps(listing))
    fsync_file(tmp / f"rank_{parts.rank:05d}.json")
    _barrier_call(collectives.barrier, "save_checkpoint")
    final = root / tag
    if parts.rank == 0:
        manifest = _merge(tmp, parts, tag, scalars, version)
        write_manifest(tmp, manifest)
        commit_dir(tmp, final)
        if save_latest:
            write_latest(root, tag)
    _barrier_call(collectives.barrier, "save_checkpoint")
    return final


def _merge(tmp: Path, parts: EngineParts, tag: str, scalars: dict[str, Any], version: str) -> Manifest:
    files: dict[str, dict[str, Any]] = {}
    tensors: dict[str, TensorEntry] = {}
    pieces: dict[str, list[Piece]] = {}
    meta: dict[str, tuple[tuple[int, ...], str, bool]] = {}
    for rank in range(parts.world_size):
        listing_path = tmp / f"rank_{rank:05d}.json"
        if not listing_path.is_file():
            raise CheckpointError(f"save_checkpoint: rank {rank} wrote no {listing_path.name}; its save failed")
        listing = json.loads(listing_path.read_text())
        listing_path.unlink()
        files[listing["file"]] = {"sha256": listing["sha256"], "bytes": listing["bytes"]}
        for key, start, end, shape, dtype, frozen in listing["pieces"]:
            pieces.setdefault(key, []).append(Piece(file=listing["file"], name=key, start=start, end=end))
            meta[key] = (tuple(shape), dtype, frozen)
    for key, found in pieces.items():
        shape, dtype, frozen = meta[key]
        tensors[key] = TensorEntry(shape=shape, dtype=dtype, pieces=sorted(found, key=lambda p: p.start), frozen=frozen)
    manifest = Manifest(format_version=FORMAT_VERSION, slipstream_version=version, tag=tag,
                        world_size=parts.world_size, zero_stage=parts.stage, files=files, tensors=tensors,
                        scalars=scalars)
    check_coverage(manifest)
    return manifest

"""`save_engine`: every rank writes its slices into one safetensors file; rank 0 writes the manifest and commits.

[Note: checkpoint save]
1. All ranks check they were given the same tag (`checkpoint.tag_validation`: WARN, IGNORE or FAIL); with WARN
   and IGNORE, different tags are replaced by rank 0's (`validate_tag`), so there is always one checkpoint.
2. Rank 0 creates save_dir, removes what earlier failed or killed saves left there (atomic.recover: any
   `.tmp-*` directory, so a full disk does not stay full) and creates an empty `save_dir/.tmp-<tag>/`.
3. Rank r writes `rank_<r>.safetensors` (its parameter slices -- fp32 masters where they exist --, its RNG
   states; rank 0 also buffers and client tensors), `rank_<r>.optim.safetensors` (its optimizer-state slices)
   and a small `rank_<r>.json` listing its pieces and the files' sha256, all durable (direct_io.py).
4. Rank 0 merges the rank lists into `manifest.json` (global shapes, pieces, sha256 per file, scalars),
   checks that the pieces cover every tensor, renames the directory into place (atomic.commit_dir) and
   only then replaces `latest`.
Each step ends with an all-gather of one failure flag per rank (`_agree`), not a bare barrier: when a rank
fails (a full disk), every rank raises at once instead of waiting out the collective timeout, and rank 0
removes the unfinished `.tmp-<tag>`. A write error names the checkpoint, the file and, for a full disk, the
bytes needed and free; the failing rank deletes its partial file first. A rank that never called save makes
the others raise within the collective timeout, naming the missing ranks. A crash at any point leaves the
previous checkpoint and `latest` untouched (the next save, or atomic.recover, tidies up what it left).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from slipstream.checkpoint.atomic import (
    LATEST_FILE,
    check_tag,
    commit_dir,
    fsync_file,
    make_tmp_dir,
    recover,
    tmp_dir_for,
    write_latest,
    write_text_atomic,
)
from slipstream.checkpoint.errors import CheckpointError, TagMismatchError
from slipstream.checkpoint.manifest import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    Manifest,
    Piece,
    TensorEntry,
    check_coverage,
    dtype_name,
)
from slipstream.checkpoint.safetensors_io import SafetensorsWriter, file_bytes
from slipstream.checkpoint.state import (
    EngineParts,
    collect_slices,
    flat_state_keys,
    optimizer_rank_tensors,
    rng_tensors,
    trainable_names,
)
from slipstream.comm import collectives
from slipstream.comm.collectives import CollectiveError
from slipstream.utils.logging import get_logger, warn_once

_Item = tuple[str, torch.Tensor, int, int, tuple[int, ...], bool]  # key, data, start, end, global shape, frozen
_DISK_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


def validate_tag(tag: str, mode: str, *, world_size: int, rank: int = 0) -> str:
    """The tag every rank saves under. Ranks compare their tags (one all-gather of a digest); when they differ,
    FAIL raises `TagMismatchError` on every rank, while WARN (with a warning) and IGNORE (with an info line)
    save under rank 0's tag, broadcast to the others: one checkpoint, and every rank in the same collectives."""
    if world_size == 1:
        return tag
    digest = int.from_bytes(hashlib.sha256(tag.encode()).digest()[:7], "little")
    tags = torch.zeros(world_size, dtype=torch.int64)
    mine = torch.tensor([digest], dtype=torch.int64)
    _barrier_call(lambda: collectives.all_gather(tags, mine), "save_checkpoint (tag check)")
    if len(set(tags.tolist())) == 1:
        return tag
    if mode.upper() == "FAIL":
        raise TagMismatchError(
            f"save_checkpoint: the ranks passed different tags (this rank: {tag!r}) and checkpoint.tag_validation "
            'is "FAIL"; pass the same tag on every rank (or none: the default global_step<N> is the same everywhere)'
        )
    chosen = _rank0_tag(tag)
    if chosen != tag:
        message = (
            f"save_checkpoint: the ranks passed different tags; this rank's {tag!r} is replaced by rank 0's "
            f"{chosen!r}, so that all ranks write one checkpoint. Pass the same tag on every rank"
        )
        if mode.upper() == "WARN":
            warn_once(f"tag-mismatch:{tag}", f"slipstream: {message} (rank {rank})")
        else:
            get_logger().info("%s (rank %d; tag_validation IGNORE)", message, rank)
    return chosen


def _rank0_tag(tag: str) -> str:
    """Rank 0's tag on every rank: its length, then its UTF-8 bytes, broadcast from rank 0."""
    data = tag.encode()
    length = torch.tensor([len(data)], dtype=torch.int64)
    _barrier_call(lambda: collectives.broadcast(length, 0), "save_checkpoint (tag check)")
    buffer = torch.zeros(int(length.item()), dtype=torch.uint8)
    if not buffer.numel():
        return ""  # rank 0's tag is empty: check_tag refuses it on every rank
    if len(data) == buffer.numel():
        buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    _barrier_call(lambda: collectives.broadcast(buffer, 0), "save_checkpoint (tag check)")
    return bytes(buffer.tolist()).decode()


def _barrier_call(call: Callable[[], object], what: str) -> None:
    try:
        call()
    except CollectiveError as exc:
        # from None: the summary is the collective's whole account; chained, the log would carry it twice
        raise CheckpointError(f"{what}: {exc.summary()}. {exc.fix_for(what.split()[0])}") from None


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
                items.append(
                    (
                        f"optimizer/{piece.name}/{key}",
                        piece.state_view(state, key),
                        piece.lo,
                        piece.hi,
                        piece.shape,
                        False,
                    )
                )
    for name, tensor in rng_tensors().items():
        items.append((f"rng/{parts.rank}/{name}", tensor, 0, tensor.numel(), (tensor.numel(),), False))
    for name, tensor in optimizer_rank_tensors(parts).items():  # the 1-bit optimizers' compression errors
        items.append((f"optimizer_rank/{parts.rank}/{name}", tensor, 0, tensor.numel(), (tensor.numel(),), False))
    if parts.rank == 0:
        for name, buffer in parts.module.named_buffers():
            items.append((f"buffer/{name}", buffer.detach(), 0, buffer.numel(), tuple(buffer.shape), False))
        for key, tensor in client_tensors.items():
            items.append((f"client/{key}", tensor, 0, tensor.numel(), tuple(tensor.shape), False))
    return items


def save_engine(
    parts: EngineParts,
    save_dir: str,
    tag: str,
    *,
    scalars: dict[str, object],
    client_tensors: dict[str, torch.Tensor],
    save_latest: bool,
    exclude_frozen: bool,
    tag_validation: str,
    version: str,
) -> Path:
    """See [Note: checkpoint save]; every phase ends with every rank learning whether some rank failed it."""
    tag = check_tag(validate_tag(tag, tag_validation, world_size=parts.world_size, rank=parts.rank))
    root = Path(save_dir)
    final, tmp = root / tag, tmp_dir_for(root, tag)
    error = _attempt(lambda: _prepare(root, tag)) if parts.rank == 0 else None
    _agree(parts, error, tmp, "preparing the save directory")
    error = _attempt(lambda: _write_rank(parts, tmp, final, client_tensors, exclude_frozen))
    _agree(parts, error, tmp, "writing its files")
    if parts.rank == 0:
        error = _attempt(
            lambda: _commit(parts, tmp, final, tag=tag, scalars=scalars, version=version, save_latest=save_latest)
        )
    _agree(parts, error, tmp, "committing the checkpoint")
    return final


def _attempt(step: Callable[[], None]) -> Exception | None:
    try:
        step()
    except Exception as exc:
        return exc
    return None


def _agree(parts: EngineParts, error: Exception | None, tmp: Path, what: str) -> None:
    """Every rank learns whether any rank failed `what`, instead of waiting out the collective timeout at a
    barrier the failed rank never reaches; then the unfinished save is removed and every rank raises."""
    failed = [parts.rank] if error is not None else []
    if parts.world_size > 1:
        flags = torch.zeros(parts.world_size, dtype=torch.int64)
        mine = torch.tensor([int(error is not None)], dtype=torch.int64)
        _barrier_call(lambda: collectives.all_gather(flags, mine), "save_checkpoint")
        failed = [rank for rank, flag in enumerate(flags.tolist()) if flag]
    if not failed:
        return
    if parts.rank == 0:  # every rank is past its writes: nothing of this save is in use any more
        shutil.rmtree(tmp, ignore_errors=True)
    if error is not None:
        raise error
    raise CheckpointError(
        f"save_checkpoint: rank(s) {failed} failed while {what} (the error on those ranks says "
        f"why); the save did not complete: {tmp} was removed and `latest` still names the previous "
        "checkpoint. Fix the cause and save again."
    )


def _prepare(root: Path, tag: str) -> None:
    """Rank 0: create save_dir, remove what earlier failed or killed saves left (a full disk must not stay
    full), and create an empty temporary directory for this save."""
    root.mkdir(parents=True, exist_ok=True)
    for action in recover(root):
        get_logger().warning(f"slipstream: save_checkpoint: {action}")
    make_tmp_dir(root, tag)


def _write_rank(
    parts: EngineParts, tmp: Path, final: Path, client_tensors: dict[str, torch.Tensor], exclude_frozen: bool
) -> None:
    """This rank's two safetensors files and its listing (`rank_<r>.json`), all fsynced. Optimizer state goes to
    `rank_<r>.optim.safetensors`, everything else to `rank_<r>.safetensors`: an export of the weights reads and
    verifies only the latter (a third of the bytes with Adam)."""
    items = _items(parts, client_tensors, exclude_frozen)
    # a key this rank holds several pieces of (a tensor-parallel shard cut along dim 1: one piece per row) is
    # stored under one name per piece, "<key>@<start>"; the listing names the stored key when it differs
    counts: dict[str, int] = {}
    for key, *_ in items:
        counts[key] = counts.get(key, 0) + 1
    stored = [key if counts[key] == 1 else f"{key}@{start}" for key, _, start, *_ in items]
    groups: dict[str, list[int]] = {}
    for index, (key, *_) in enumerate(items):
        suffix = "optim.safetensors" if key.startswith("optimizer/") else "safetensors"
        groups.setdefault(f"rank_{parts.rank:05d}.{suffix}", []).append(index)
    files: dict[str, dict[str, Any]] = {}
    pieces: list[list[Any]] = []
    for file_name, indices in groups.items():
        entries: list[tuple[str, torch.dtype, tuple[int, ...]]] = [
            (stored[i], items[i][1].dtype, (items[i][3] - items[i][2],)) for i in indices
        ]
        path = tmp / file_name
        record: dict[str, Any] = {}
        tensors = [(stored[i], items[i][1]) for i in indices]
        _on_disk(
            functools.partial(_write_file, path, entries, tensors, record),
            path=path,
            needed=file_bytes(entries),
            final=final,
        )
        files[file_name] = record
        for i in indices:
            key, data, start, end, shape, frozen = items[i]
            pieces.append([file_name, key, start, end, list(shape), dtype_name(data.dtype), frozen, stored[i]])
    text = json.dumps({"files": files, "pieces": pieces})
    listing_path = tmp / f"rank_{parts.rank:05d}.json"

    def write_listing() -> None:
        listing_path.write_text(text)
        fsync_file(listing_path)

    _on_disk(write_listing, path=listing_path, needed=len(text.encode()), final=final)


def _write_file(
    path: Path,
    entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
    tensors: list[tuple[str, torch.Tensor]],
    record: dict[str, object],
) -> None:
    """One safetensors file of flattened tensors; its sha256 and size go into `record`."""
    with SafetensorsWriter(path, entries) as writer:
        for name, data in tensors:
            writer.write(name, data.detach().reshape(-1).to("cpu"))
        record.update(sha256=writer.close(), bytes=writer.bytes_written)


def _commit(
    parts: EngineParts, tmp: Path, final: Path, *, tag: str, scalars: dict[str, object], version: str, save_latest: bool
) -> None:
    """Rank 0: merge the listings into the manifest, rename the directory into place, then point `latest`."""
    text = _merge(tmp, parts, tag, scalars, version).to_json()
    _on_disk(
        lambda: write_text_atomic(tmp / MANIFEST_FILE, text),
        path=tmp / MANIFEST_FILE,
        needed=len(text.encode()),
        final=final,
    )
    commit_dir(tmp, final)
    if save_latest:  # write_text_atomic removes its own temporary file; `latest` itself must stay
        _on_disk(
            lambda: write_latest(final.parent, tag),
            path=final.parent / LATEST_FILE,
            needed=len(tag.encode()),
            final=final,
            remove_partial=False,
        )


def _on_disk(write: Callable[[], None], *, path: Path, needed: int, final: Path, remove_partial: bool = True) -> None:
    """Run `write`, which creates `path`; an OSError becomes a CheckpointError naming the checkpoint, the file,
    and for a full disk the bytes needed and free. The partial file goes first, so it frees what it took."""
    try:
        write()
    except OSError as exc:
        if remove_partial:
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
        raise _write_error(exc, path=path, needed=needed, final=final) from exc


def _write_error(exc: OSError, *, path: Path, needed: int, final: Path) -> CheckpointError:
    unchanged = (
        "The save did not complete: its unfinished files are removed and `latest` still names the previous checkpoint."
    )
    if exc.errno not in _DISK_FULL:
        return CheckpointError(f"save_checkpoint: writing {path} for checkpoint {final} failed: {exc}. {unchanged}")
    try:
        free = f"{shutil.disk_usage(path.parent).free:,} bytes free"
    except OSError:
        free = "an unknown number of bytes free"
    return CheckpointError(
        f"save_checkpoint: no space left for checkpoint {final}: {path.name} needs {needed:,} bytes and the file "
        f"system holding {path.parent} has {free} ({exc.strerror}, errno {exc.errno}). {unchanged} Free space "
        f"(for example delete old tags under {final.parent}) or save to another save_dir, then save again."
    )


def _merge(tmp: Path, parts: EngineParts, tag: str, scalars: dict[str, object], version: str) -> Manifest:
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
        files.update(listing["files"])
        for file_name, key, start, end, shape, dtype, frozen, name in listing["pieces"]:
            pieces.setdefault(key, []).append(Piece(file=file_name, name=name, start=start, end=end))
            meta[key] = (tuple(shape), dtype, frozen)
    for key, found in pieces.items():
        shape, dtype, frozen = meta[key]
        tensors[key] = TensorEntry(shape=shape, dtype=dtype, pieces=sorted(found, key=lambda p: p.start), frozen=frozen)
    manifest = Manifest(
        format_version=FORMAT_VERSION,
        slipstream_version=version,
        tag=tag,
        world_size=parts.world_size,
        zero_stage=parts.stage,
        files=files,
        tensors=tensors,
        scalars=scalars,
    )
    check_coverage(manifest)
    return manifest

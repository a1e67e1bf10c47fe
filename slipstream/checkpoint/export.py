"""Export a native checkpoint's model weights as Hugging Face-style safetensors, one tensor in memory at a time.

Owns the export plan (which tensor goes to which shard, decided from the manifest's shapes before any bytes
are read), the streaming copy (read one global tensor, cast it, write it, drop it), the HF file names
(`model.safetensors`, or `model-00001-of-0000N.safetensors` plus `model.safetensors.index.json`), size
strings such as "5GB", and the text progress bar.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from slipstream.checkpoint.atomic import replaced_atomically, write_text_atomic
from slipstream.checkpoint.errors import CheckpointError
from slipstream.checkpoint.manifest import parse_dtype
from slipstream.checkpoint.reader import CheckpointReader, resolve_checkpoint_dir
from slipstream.checkpoint.safetensors_io import SafetensorsWriter
from slipstream.utils.progress import Progress

MODULE_PREFIX = "module/"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
EXPORT_DTYPES = ("fp32", "bf16", "fp16")


def parse_size(size: int | str) -> int:
    """Bytes in "5GB" (powers of 10), "1.5GiB" (powers of 2), "500MB", "123" or an int; must be positive."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([a-zA-Z]*)\s*", str(size))
        unit = match.group(2).upper() if match else ""
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"size {size!r} is not understood; write an integer byte count or a number with a "
                "unit: B, KB, MB, GB, TB (powers of 10) or KiB, MiB, GiB, TiB (powers of 2), e.g. '5GB'"
            )
        value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"size {size!r} must be positive, e.g. '5GB'")
    return value


@dataclass(frozen=True, slots=True)
class ExportItem:
    """One output tensor: its checkpoint key, its name in the exported files and its output dtype."""

    key: str
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * self.dtype.itemsize


def plan_shards(items: list[ExportItem], max_shard_size: int) -> list[list[ExportItem]]:
    """Greedy HF sharding in order: start a new shard when the next tensor would pass `max_shard_size`.

    A tensor larger than the limit gets a shard of its own.
    """
    shards: list[list[ExportItem]] = [[]]
    used = 0
    for item in items:
        if shards[-1] and used + item.nbytes > max_shard_size:
            shards.append([])
            used = 0
        shards[-1].append(item)
        used += item.nbytes
    return shards if shards[0] else []


def shard_file_names(num_shards: int, *, pickle: bool = False) -> list[str]:
    """HF's file names: model.safetensors / model-0000i-of-0000N.safetensors, or with `pickle` (torch.save)
    pytorch_model.bin / pytorch_model-0000i-of-0000N.bin."""
    stem, suffix = ("pytorch_model", ".bin") if pickle else ("model", ".safetensors")
    if num_shards == 1:
        return [stem + suffix]
    return [f"{stem}-{i:05d}-of-{num_shards:05d}{suffix}" for i in range(1, num_shards + 1)]


def _output_dtype(stored: torch.dtype, dtype: str | None) -> torch.dtype:
    """Floating tensors take the requested dtype; integer and bool tensors keep theirs (as HF does)."""
    if dtype is None or not stored.is_floating_point:
        return stored
    return parse_dtype(dtype)


def export_items(
    reader: CheckpointReader, *, dtype: str | None = None, exclude_frozen: bool = False
) -> list[ExportItem]:
    """The `module/` tensors of a checkpoint as export items, names without the prefix, in manifest order."""
    items = []
    for key, entry in reader.manifest.tensors.items():
        if not key.startswith(MODULE_PREFIX) or (exclude_frozen and entry.frozen):
            continue
        items.append(
            ExportItem(
                key=key,
                name=key[len(MODULE_PREFIX) :],
                dtype=_output_dtype(entry.torch_dtype, dtype),
                shape=tuple(entry.shape),
            )
        )
    return items


def write_items(
    reader: CheckpointReader,
    items: list[ExportItem],
    out_dir: Path,
    *,
    max_shard_size: int,
    progress: bool,
    pickle: bool = False,
    tied: dict[str, str] | None = None,
) -> list[Path]:
    """Stream `items` into HF-named shards under `out_dir` (+ the index when there are several); returns the files.
    Safetensors hold one tensor in memory at a time; `pickle` (torch.save files, DeepSpeed's zero_to_fp32 default)
    holds one shard, and there each `tied` name (name -> the name it shares its tensor with) is saved as the same
    tensor object, as DeepSpeed's zero_to_fp32 writes tied parameters."""
    tied_to: dict[str, list[str]] = {}
    for name, owner in (tied or {}).items() if pickle else ():
        tied_to.setdefault(owner, []).append(name)
    shards = plan_shards(items, max_shard_size)
    names = shard_file_names(len(shards), pickle=pickle)
    bar = Progress("export", sum(item.nbytes for item in items), unit="MB", scale=1e6, enabled=progress)
    written = []
    for file_name, shard in zip(names, shards):
        if pickle:
            state = {}
            for item in shard:
                state[item.name] = reader.read(item.key).to(item.dtype)
                for name in tied_to.get(item.name, []):
                    state[name] = state[item.name]
                bar.advance(item.nbytes, item.name[-40:])
            with replaced_atomically(out_dir / file_name) as tmp:
                torch.save(state, tmp)
            del state
        else:
            entries = [(item.name, item.dtype, item.shape) for item in shard]
            with (
                replaced_atomically(out_dir / file_name) as tmp,
                SafetensorsWriter(tmp, entries, metadata={"format": "pt"}) as writer,
            ):
                for item in shard:
                    tensor = reader.read(item.key).to(item.dtype)
                    writer.write(item.name, tensor)
                    del tensor  # one tensor in memory at a time
                    bar.advance(item.nbytes, item.name[-40:])
        written.append(out_dir / file_name)
    bar.finish()
    if len(shards) > 1:
        index_file = "pytorch_model.bin.index.json" if pickle else INDEX_FILE
        index = {
            "metadata": {"total_size": sum(item.nbytes for item in items)},
            "weight_map": {
                name: file_name
                for file_name, shard in zip(names, shards)
                for item in shard
                for name in [item.name, *tied_to.get(item.name, [])]
            },
        }
        write_text_atomic(out_dir / index_file, json.dumps(index, indent=2) + "\n")
        written.append(out_dir / index_file)
    return written


def export_checkpoint(
    ckpt_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    tag: str | None = None,
    dtype: str | None = None,
    max_shard_size: int | str = "5GB",
    progress: bool = True,
) -> Path:
    """Write the model weights of a checkpoint as HF-style safetensors under `out_dir`; returns `out_dir`.

    `ckpt_dir` is a save_dir (the tag comes from `tag` or its `latest` file) or a checkpoint directory holding
    manifest.json. `dtype` ("fp32", "bf16", "fp16") casts floating tensors; None keeps the stored dtypes.
    The files holding model weights are verified against their sha256 as they are read (each byte is read once);
    when one does not match, the files written are deleted and CheckpointCorrupt names it.
    """
    if dtype is not None and dtype not in EXPORT_DTYPES:
        raise ValueError(
            f"export dtype {dtype!r} is not supported; use one of {EXPORT_DTYPES} or None to keep the stored dtypes"
        )
    limit = parse_size(max_shard_size)
    source = resolve_checkpoint_dir(ckpt_dir, tag)
    out = Path(out_dir)
    with CheckpointReader(source, verify="stream") as reader:  # presence and sizes now, hashes while reading
        items = export_items(reader, dtype=dtype)
        if not items:
            raise CheckpointError(
                f"checkpoint {source} holds no model tensors (keys starting with {MODULE_PREFIX!r}); nothing to export"
            )
        out.mkdir(parents=True, exist_ok=True)
        shards = len(plan_shards(items, limit))
        outputs = [out / name for name in shard_file_names(shards)] + ([out / INDEX_FILE] if shards > 1 else [])
        try:
            write_items(reader, items, out, max_shard_size=limit, progress=progress)
            reader.verify_read()  # the files read match their sha256, else nothing of this export stays
        except BaseException:
            for path in outputs:
                path.unlink(missing_ok=True)
            raise
    return out

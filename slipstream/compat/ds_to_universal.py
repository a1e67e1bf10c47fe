"""DeepSpeed's `deepspeed.checkpoint.ds_to_universal`: convert a checkpoint into the universal layout.

Owns the DeepSpeed command line (`python -m slipstream.checkpoint.ds_to_universal --input_folder ckpt/global_stepN
--output_folder ckpt/global_stepN_universal`; the DeepSpeed path is an alias declared in compat/aliases.py) and
`main(args)`. The input is a Slipstream checkpoint (manifest.json), a DeepSpeed folder whose ranks hold
tensor-parallel shards or ZeRO-3 partitions (a ZeRO-3 one, with or without AutoTP, or a ZeRO-1/2 one saved with
tensor or pipeline parallelism: checkpoint/deepspeed/tp_universal.py, written as DeepSpeed writes it), or a data-parallel
DeepSpeed 0.19 ZeRO-0/1/2 one (`*model_states.pt`); the other writing is checkpoint/deepspeed/universal.py. Unlike DeepSpeed's converter no per-rank fragments are extracted and merged through
a temporary folder: the readers give whole tensors (or whole tensor-parallel shards, merged in memory), so the
worker and temporary-folder options have nothing to do (they are accepted, and the help says so). DeepSpeed's
helper names that client code and DeepSpeed's tests use are exported too: `merge_tp_slices` and
`_merge_zero_shards` over DeepSpeed's own fragment folder (compat/tp_slice_files.py), `_group_per_tp_shapes`,
the metadata checks (compat/ds_conversion_checks.py) and `DeepSpeedCheckpoint` (the folder descriptor,
checkpoint/deepspeed/folder.py). When the output folder
sits next to the input folder (in the save_dir), `latest_universal` there names it, so
`"checkpoint": {"load_universal": true}` loads it with `load_checkpoint(save_dir)`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from slipstream.checkpoint.deepspeed.folder import DeepSpeedCheckpointFolder as DeepSpeedCheckpoint
from slipstream.checkpoint.deepspeed.tp_shards import check_conversion_support as _validate_autotp_conversion_support
from slipstream.compat.ds_conversion_checks import (
    _aggregate_autoep_zero12_metadata,
    _check_for_required_state,
    _inject_missing_state,
)
from slipstream.compat.tp_slice_files import _group_per_tp_shapes, _merge_zero_shards, merge_tp_slices

__all__ = [
    "DeepSpeedCheckpoint",
    "_aggregate_autoep_zero12_metadata",
    "_check_for_required_state",
    "_group_per_tp_shapes",
    "_inject_missing_state",
    "_merge_zero_shards",
    "_validate_autotp_conversion_support",
    "main",
    "merge_tp_slices",
    "parse_arguments",
]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m slipstream.checkpoint.ds_to_universal",
        description="Convert a Slipstream or DeepSpeed checkpoint (a global_stepN folder) into DeepSpeed's "
        "universal checkpoint layout, loadable at any world size and ZeRO stage.",
    )
    parser.add_argument("--input_folder", required=True, help="the checkpoint's tag folder (e.g. ckpt/global_step100)")
    parser.add_argument("--output_folder", required=True, help="where to write the universal checkpoint")
    no_effect = "accepted for DeepSpeed's command line; no effect here: tensors are read whole, one at a time"
    parser.add_argument("--num_extract_workers", type=int, default=4, help=no_effect)
    parser.add_argument("--num_merge_workers", type=int, default=2, help=no_effect)
    parser.add_argument("--keep_temp_folder", action="store_true", help=no_effect + " (no temporary folder)")
    parser.add_argument(
        "--no_strict", dest="strict", action="store_false", help="skip the check that every tensor was written"
    )
    parser.add_argument(
        "--inject_missing_state",
        action="store_true",
        help="convert a ZeRO-1/2 tensor- or pipeline-parallel folder that records no universal_checkpoint_info, "
        "concatenating every parameter along dim 0 (other inputs need no such info)",
    )
    return parser


def parse_arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return _parser().parse_args(argv)


def main(args: Any = None) -> Path:
    """Convert `args.input_folder` into `args.output_folder` (an argparse namespace, or None: read sys.argv)."""
    from slipstream.checkpoint.deepspeed.reader import _tag_dir, is_deepspeed_checkpoint, read_deepspeed_checkpoint
    from slipstream.checkpoint.deepspeed.tp_universal import convert_sharded_folder, is_sharded_folder
    from slipstream.checkpoint.deepspeed.universal import (
        LATEST_UNIVERSAL_FILE,
        checkpoint_from_reader,
        write_universal_checkpoint,
    )
    from slipstream.checkpoint.errors import CheckpointError
    from slipstream.checkpoint.reader import CheckpointReader

    if args is None:
        args = parse_arguments()
    source, out = Path(args.input_folder), Path(args.output_folder)
    if (source / "manifest.json").is_file():
        with CheckpointReader(source) as reader:
            checkpoint = checkpoint_from_reader(reader)
        model_state_files = None
    elif is_deepspeed_checkpoint(source) and is_sharded_folder(_tag_dir(source, None)):
        tag_dir = _tag_dir(source, None)
        print(f"ds_to_universal: {tag_dir} (DeepSpeed, sharded ranks) -> {out}")
        read = convert_sharded_folder(
            tag_dir,
            out,
            strict=getattr(args, "strict", True),
            inject_missing_state=getattr(args, "inject_missing_state", False),
        )
        print(
            f"ds_to_universal: {read['parameters']} parameters, ZeRO {'3' if read['zero_stage'] == 3 else '1/2'}, "
            f"{read['tp_degree']} tensor-parallel ranks"
        )
        _write_latest_universal(source, out, LATEST_UNIVERSAL_FILE)
        return out
    elif is_deepspeed_checkpoint(source):
        checkpoint = read_deepspeed_checkpoint(source)
        model_state_files = sorted(source.glob("*model_states.pt"))
        if not model_state_files:  # a save_dir with `latest` was given: the files are in the tag folder
            model_state_files = sorted((source / checkpoint.tag).glob("*model_states.pt"))
    else:
        raise CheckpointError(
            f"--input_folder {source} is neither a Slipstream checkpoint (no manifest.json) nor a DeepSpeed one (no "
            "*model_states.pt); pass the global_stepN folder that save_checkpoint wrote"
        )
    print(
        f"ds_to_universal: {source} ({len(checkpoint.master)} parameters, ZeRO stage {checkpoint.zero_stage}, "
        f"{checkpoint.world_size} ranks) -> {out}"
    )
    write_universal_checkpoint(checkpoint, out, model_state_files=model_state_files)
    if getattr(args, "strict", True):  # every parameter's folder is there (without reading the tensors back)
        missing = sorted(name for name in checkpoint.master if not (out / "zero" / name / "fp32.pt").is_file())
        if missing:
            raise CheckpointError(f"{out}: the conversion lost {missing}; the output folder is incomplete")
    _write_latest_universal(source, out, LATEST_UNIVERSAL_FILE)
    return out


def _write_latest_universal(source: Path, out: Path, file_name: str) -> None:
    """Next to the input folder (in the save_dir), name the output as the universal checkpoint to load."""
    if out.resolve().parent == source.resolve().parent:
        (out.parent / file_name).write_text(out.name)
        print(f"ds_to_universal: {out.parent / file_name} names {out.name}")


if __name__ == "__main__":
    main()
    sys.exit(0)

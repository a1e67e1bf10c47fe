"""`slipstream export`: checkpoint -> Hugging Face-style safetensors; the logic is checkpoint/export.py.

Owns the command line. torch is imported only when the command runs, so `slipstream --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys

HELP = "write a checkpoint's model weights as Hugging Face-style sharded safetensors (streaming)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("ckpt_dir", help="the save_dir given to save_checkpoint, or one checkpoint (tag) directory")
    parser.add_argument("out_dir", help="output directory for model*.safetensors (created if missing)")
    parser.add_argument("--tag", default=None, help="checkpoint tag under CKPT_DIR (default: the `latest` file)")
    parser.add_argument(
        "--dtype",
        choices=("fp32", "bf16", "fp16"),
        default=None,
        help="cast floating tensors to this dtype (default: keep the stored dtypes)",
    )
    parser.add_argument(
        "--max-shard-size",
        "--max_shard_size",
        dest="max_shard_size",
        default="5GB",
        help="largest output file, e.g. 5GB, 500MB, 1.5GiB (default: 5GB)",
    )
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="hide the progress bar")


def run(args: argparse.Namespace) -> int:
    from slipstream.checkpoint.errors import CheckpointError
    from slipstream.checkpoint.export import export_checkpoint

    try:
        out = export_checkpoint(
            args.ckpt_dir,
            args.out_dir,
            tag=args.tag,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            progress=args.progress,
        )
    except (CheckpointError, ValueError, OSError) as exc:
        print(f"slipstream export: error: {exc}", file=sys.stderr)
        return 1
    print(f"exported to {out}")
    return 0

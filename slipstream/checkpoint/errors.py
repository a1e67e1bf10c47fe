"""Checkpoint errors: one base class so callers can catch every checkpoint problem at once.

`CheckpointError` covers a checkpoint that cannot be read as asked (missing manifest, unknown format version,
inconsistent pieces); `CheckpointCorrupt` means files on disk do not match the manifest (missing, wrong size,
wrong sha256); `UnsafeCheckpoint` means a foreign (pickle) checkpoint asked for something the restricted
loader does not allow.
"""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint cannot be read or written as asked; the message names the file or key and the fix."""


class CheckpointCorrupt(CheckpointError):
    """Files of a checkpoint do not match its manifest (missing, wrong size or wrong sha256)."""


class UnsafeCheckpoint(CheckpointError):
    """A pickle-based checkpoint references a global outside the restricted loader's allow-list."""


class TagMismatchError(CheckpointError, AssertionError):
    """Ranks passed different tags to save_checkpoint with `checkpoint.tag_validation` FAIL (an AssertionError
    too: DeepSpeed asserts there)."""


class ConversionMetadataError(CheckpointError, AssertionError):
    """The tensor-parallel metadata of a DeepSpeed-format checkpoint (sub-parameter widths, slice shapes) does
    not describe its tensors (an AssertionError too: DeepSpeed's converter asserts there)."""

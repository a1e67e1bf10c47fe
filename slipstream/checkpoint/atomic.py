"""Crash-safe filesystem steps for checkpoints: fsync, atomic text files, directory commit and recovery.

Pure filesystem code with no torch.distributed: the engine adds the barriers around these steps.

[Note: checkpoint commit] A save writes everything into `save_dir/.tmp-<tag>`, then `commit_dir` fsyncs every
file and the directory, moves an existing `save_dir/<tag>` aside to `save_dir/.old-<tag>-<pid>`, renames the
temporary directory to `save_dir/<tag>`, fsyncs `save_dir` and only then deletes the old copy. `latest` is
rewritten (atomically) after the commit. A crash at any point therefore leaves either the old or the new
complete directory at `<tag>`, or, in the window between the two renames, the old one at `.old-<tag>-<pid>`,
which `recover(save_dir)` moves back. Nothing under a `.tmp-*` name is ever read as a checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

LATEST_FILE = "latest"
"""Name of the file in save_dir that holds the tag of the newest checkpoint (as DeepSpeed)."""
_TMP_PREFIX = ".tmp-"
_OLD_PREFIX = ".old-"


def check_tag(tag: str) -> str:
    """Return `tag` if it can name a checkpoint directory, else raise ValueError saying why."""
    if (
        not isinstance(tag, str)
        or not tag
        or tag in (".", "..", LATEST_FILE)
        or tag.startswith(".")
        or "/" in tag
        or "\\" in tag
        or "\0" in tag
    ):
        raise ValueError(
            f"checkpoint tag {tag!r} cannot name a directory: use a non-empty name without '/', "
            f"not starting with '.' and not {LATEST_FILE!r} (the default is 'global_step<N>')"
        )
    return tag


def fsync_file(path: str | os.PathLike[str]) -> None:
    """Flush a file's data and metadata to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Flush a directory's entries (renames, new files) to stable storage; a no-op where unsupported."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
    try:
        fd = os.open(path, flags)
    except (PermissionError, IsADirectoryError):  # Windows cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on directories; the rename is still atomic
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def replaced_atomically(path: str | os.PathLike[str]) -> Iterator[Path]:
    """`with replaced_atomically(path) as tmp:` write the file at `tmp`; on success it is made durable and renamed
    over `path`, so readers (and other processes writing the same file, such as every rank exporting the same
    checkpoint) see a whole old or a whole new file, never a partial one; on an error `tmp` is removed."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        yield tmp
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Replace `path` with `text` so readers see the old or the new content, never a partial file."""
    with replaced_atomically(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def tmp_dir_for(save_dir: str | os.PathLike[str], tag: str) -> Path:
    """Where a save of `tag` is written before `commit_dir`: `save_dir/.tmp-<tag>` (not created here)."""
    return Path(save_dir) / f"{_TMP_PREFIX}{check_tag(tag)}"


def make_tmp_dir(save_dir: str | os.PathLike[str], tag: str) -> Path:
    """Create an empty `tmp_dir_for(save_dir, tag)`, removing a stale one left by an earlier crash.

    Call it on one rank, then barrier, then let every rank write its files into the returned directory.
    """
    tmp = tmp_dir_for(save_dir, tag)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    fsync_dir(tmp.parent)
    return tmp


def commit_dir(tmp: str | os.PathLike[str], final: str | os.PathLike[str]) -> None:
    """Atomically put the finished directory `tmp` at `final`. See [Note: checkpoint commit]."""
    tmp, final = Path(tmp), Path(final)
    if tmp.parent.resolve() != final.parent.resolve():
        raise ValueError(
            f"commit_dir needs {tmp} and {final} in the same directory (a rename must not cross "
            "file systems); write the save into tmp_dir_for(save_dir, tag)"
        )
    for path in sorted(tmp.rglob("*")):
        if path.is_file():
            fsync_file(path)
        elif path.is_dir():
            fsync_dir(path)
    fsync_dir(tmp)
    old = None
    if final.exists():
        old = final.with_name(f"{_OLD_PREFIX}{final.name}-{os.getpid()}")
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old)


def _old_tag(name: str) -> str | None:
    """`<tag>` out of `.old-<tag>-<pid>`, or None for any other name."""
    if not name.startswith(_OLD_PREFIX):
        return None
    tag, sep, pid = name[len(_OLD_PREFIX) :].rpartition("-")
    return tag if sep and tag and pid.isdigit() else None


def recover(save_dir: str | os.PathLike[str]) -> list[str]:
    """Undo what a crash during a save left in `save_dir`; returns one line per action taken.

    An orphaned `.old-<tag>-<pid>` goes back to `<tag>` when `<tag>` is missing (the crash hit between the two
    renames of `commit_dir`) and is deleted otherwise; `.tmp-*` directories and `latest.tmp-*` files are deleted.
    Run it on one rank while no save is in progress (it deletes in-progress temporary directories).
    """
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return []
    actions: list[str] = []
    for path in sorted(save_dir.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True):
        tag = _old_tag(path.name)
        if tag is not None and path.is_dir():
            target = save_dir / tag
            if target.exists():
                shutil.rmtree(path)
                actions.append(f"removed {path} (a newer {target} is complete)")
            else:
                os.replace(path, target)
                actions.append(f"restored {target} from {path} (a save crashed before replacing it)")
        elif path.name.startswith(_TMP_PREFIX) and path.is_dir():
            shutil.rmtree(path)
            actions.append(f"removed unfinished save {path}")
        elif path.name.startswith(f"{LATEST_FILE}.tmp-") and path.is_file():
            path.unlink()
            actions.append(f"removed {path}")
    if actions:
        fsync_dir(save_dir)
    return actions


def read_latest(save_dir: str | os.PathLike[str], *, name: str = LATEST_FILE) -> str | None:
    """The tag in `save_dir/latest` (or `save_dir/<name>`: `latest_universal`), or None when there is no such file."""
    try:
        text = (Path(save_dir) / name).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    return text or None


def write_latest(save_dir: str | os.PathLike[str], tag: str) -> None:
    """Atomically point `save_dir/latest` at `tag` (DeepSpeed's format: the tag, no newline)."""
    write_text_atomic(Path(save_dir) / LATEST_FILE, check_tag(tag))

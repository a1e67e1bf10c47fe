"""Atomic commit of a checkpoint directory, `latest`, and recovery after a crash between the steps."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from slipstream.checkpoint.atomic import (commit_dir, make_tmp_dir, read_latest, recover, tmp_dir_for,
                                          write_latest, write_text_atomic)


def _save(save_dir: Path, tag: str, content: str) -> Path:
    tmp = make_tmp_dir(save_dir, tag)
    (tmp / "data.txt").write_text(content)
    (tmp / "sub").mkdir()
    (tmp / "sub" / "more.txt").write_text(content)
    return tmp


def test_commit_new_and_replace(tmp_path: Path) -> None:
    commit_dir(_save(tmp_path, "step1", "v1"), tmp_path / "step1")
    assert (tmp_path / "step1" / "data.txt").read_text() == "v1"
    commit_dir(_save(tmp_path, "step1", "v2"), tmp_path / "step1")
    assert (tmp_path / "step1" / "sub" / "more.txt").read_text() == "v2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step1"]  # no .tmp-/.old- left


def test_make_tmp_dir_replaces_stale_one(tmp_path: Path) -> None:
    stale = tmp_dir_for(tmp_path, "t")
    stale.mkdir()
    (stale / "junk").write_text("x")
    assert list(make_tmp_dir(tmp_path, "t").iterdir()) == []


def test_latest_roundtrip(tmp_path: Path) -> None:
    assert read_latest(tmp_path) is None
    write_latest(tmp_path, "global_step5")
    assert (tmp_path / "latest").read_text() == "global_step5"
    assert read_latest(tmp_path) == "global_step5"
    write_text_atomic(tmp_path / "latest", "global_step6\n")
    assert read_latest(tmp_path) == "global_step6"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]


@pytest.mark.parametrize("tag", ["", ".hidden", "a/b", "latest", ".."])
def test_bad_tags(tmp_path: Path, tag: str) -> None:
    with pytest.raises(ValueError, match="cannot name a directory"):
        write_latest(tmp_path, tag)


def test_crash_between_renames_recovers_old(tmp_path: Path) -> None:
    """Crash after moving the old copy aside, before the new one was renamed in: the old one comes back."""
    commit_dir(_save(tmp_path, "step1", "old"), tmp_path / "step1")
    _save(tmp_path, "step1", "new")  # the new save is complete in .tmp-step1 ...
    os.replace(tmp_path / "step1", tmp_path / ".old-step1-4242")  # ... and the first rename happened
    (tmp_path / "latest.tmp-4242").write_text("half")
    actions = recover(tmp_path)
    assert any("restored" in a for a in actions)
    assert (tmp_path / "step1" / "data.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step1"]


def test_crash_after_second_rename_keeps_new(tmp_path: Path) -> None:
    """Crash after the new directory is in place, before the old one was deleted: the new one stays."""
    commit_dir(_save(tmp_path, "step1", "old"), tmp_path / "step1")
    os.replace(tmp_path / "step1", tmp_path / ".old-step1-4242")
    os.replace(_save(tmp_path, "step1", "new"), tmp_path / "step1")
    recover(tmp_path)
    assert (tmp_path / "step1" / "data.txt").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step1"]


def test_crash_before_commit_leaves_old_and_latest(tmp_path: Path) -> None:
    commit_dir(_save(tmp_path, "step1", "old"), tmp_path / "step1")
    write_latest(tmp_path, "step1")
    _save(tmp_path, "step2", "partial")  # crashed while writing step2
    assert recover(tmp_path) == [f"removed unfinished save {tmp_path / '.tmp-step2'}"]
    assert read_latest(tmp_path) == "step1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step1"]
    assert recover(tmp_path / "missing") == []


def test_commit_refuses_cross_directory(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    tmp = _save(tmp_path / "a", "t", "x")
    with pytest.raises(ValueError, match="same directory"):
        commit_dir(tmp, tmp_path / "t")


def test_replaced_atomically_shows_a_whole_old_or_new_file(tmp_path: Path) -> None:
    """Every rank of a job may export the same checkpoint to the same file (DeepSpeed's tests call
    convert_zero_checkpoint_to_fp32_state_dict on each rank): a reader must never see a partial file."""
    from slipstream.checkpoint.atomic import replaced_atomically

    target = tmp_path / "pytorch_model.bin"
    target.write_bytes(b"old" * 1000)
    with replaced_atomically(target) as tmp:
        tmp.write_bytes(b"new")  # half-way: the target still holds the old, whole file
        assert target.read_bytes() == b"old" * 1000 and tmp.parent == target.parent
    assert target.read_bytes() == b"new" and not list(tmp_path.glob("*.tmp-*"))
    with pytest.raises(RuntimeError, match="disk"), replaced_atomically(target) as tmp:
        tmp.write_bytes(b"partial")
        raise RuntimeError("disk full")
    assert target.read_bytes() == b"new" and not list(tmp_path.glob("*.tmp-*"))

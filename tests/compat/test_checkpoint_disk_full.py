"""A save that fills the disk fails with a message naming the checkpoint, the file, the bytes needed and free,
removes what it wrote, and the next save, once space is freed, succeeds and removes what a killed save left.

The disk is a real 1 MiB tmpfs, mounted by a child process inside its own mount namespace (`unshare
--map-root-user --mount`), so the mount disappears with the child whatever happens to the test; the test
skips where neither root nor unprivileged user namespaces allow that mount.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHILD = r"""
import json, shutil, subprocess, sys, time
from pathlib import Path
mnt = Path(sys.argv[1])
mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
if mounted.returncode:
    print(json.dumps({"skip": f"cannot mount a tmpfs: {mounted.stderr.strip()}"}))
    sys.exit(0)
import torch, slipstream
from torch import nn
from slipstream.checkpoint import CheckpointReader, read_latest
from slipstream.checkpoint.errors import CheckpointError

config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
          "zero_optimization": {"stage": 2}}
engine, *_ = slipstream.initialize(model=nn.Sequential(nn.Linear(128, 128)), config=config)
engine.backward(engine(torch.randn(2, 128)).sum()); engine.step()
save_dir = mnt / "ckpt"
out = {"total": shutil.disk_usage(mnt).total}
engine.save_checkpoint(save_dir, tag="first")
out["checkpoint_bytes"] = sum(p.stat().st_size for p in (save_dir / "first").iterdir())
out["rank_file_bytes"] = (save_dir / "first" / "rank_00000.safetensors").stat().st_size
filler = mnt / "filler"
filler.write_bytes(b"\0" * (shutil.disk_usage(mnt).free - 40_000))  # ~40 kB left: the next save cannot fit
used_before = shutil.disk_usage(mnt).used
start = time.monotonic()
try:
    engine.save_checkpoint(save_dir, tag="second")
    out["error"] = None
except CheckpointError as exc:
    out["error"], out["cause"] = str(exc), repr(exc.__cause__)
out["fail_s"] = time.monotonic() - start
out["used_grew_by"] = shutil.disk_usage(mnt).used - used_before
out["after_failure"] = sorted(p.name for p in save_dir.iterdir())
out["latest_after_failure"] = read_latest(save_dir)
# the user frees space; then a save killed by SIGKILL (it cannot clean up) leaves all but ~100 kB of it taken
filler.unlink()
leftover = save_dir / ".tmp-killed"
leftover.mkdir()
(leftover / "rank_00000.safetensors").write_bytes(b"\1" * (shutil.disk_usage(mnt).free - 100_000))
out["free_with_leftover"] = shutil.disk_usage(mnt).free
engine.save_checkpoint(save_dir, tag="third")
out["after_success"] = sorted(p.name for p in save_dir.iterdir())
out["latest"] = read_latest(save_dir)
with CheckpointReader(save_dir / "third") as reader:  # sha256 of every file
    out["verified"] = any(k.startswith("module/") for k in reader.keys())
print(json.dumps(out))
"""


def test_a_full_disk_is_named_cleaned_up_and_survivable(tmp_path: Path) -> None:
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("needs util-linux `unshare` to mount a private tmpfs")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run([unshare, "--map-root-user", "--mount", sys.executable, "-c", CHILD, str(mnt)], env=env,
                            capture_output=True, text=True, timeout=120, check=False)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 and not lines and "unshare" in result.stderr:
        pytest.skip(f"cannot create a mount namespace here: {result.stderr.strip()[-300:]}")
    assert result.returncode == 0 and lines, f"child failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    out = json.loads(lines[-1])
    if "skip" in out:
        pytest.skip(out["skip"])
    error = out["error"]
    assert error is not None, "a save onto a full disk must fail"
    # the message names the checkpoint directory, the file, the bytes it needs and the bytes free
    assert f"{mnt}/ckpt/second" in error and "rank_00000.safetensors" in error, error
    needed, free = error.split(" needs ")[1].split(" bytes")[0], error.split(" has ")[1].split(" bytes free")[0]
    needed_bytes, free_bytes = int(needed.replace(",", "")), int(free.replace(",", ""))
    assert needed_bytes == out["rank_file_bytes"] and 0 < free_bytes < needed_bytes, (error, out)
    assert "No space left on device" in error and "errno 28" in error and "save again" in error
    assert out["cause"].startswith("OSError(28"), out["cause"]
    # nothing of the failed save is left; the previous checkpoint is still the latest
    assert out["used_grew_by"] <= 0 and out["after_failure"] == ["first", "latest"], out
    assert out["latest_after_failure"] == "first"
    # without removing the killed save's leftover, the next save would not fit
    assert out["free_with_leftover"] < out["checkpoint_bytes"], out
    assert out["after_success"] == ["first", "latest", "third"] and out["latest"] == "third" and out["verified"], out
    assert out["fail_s"] < 5.0, out

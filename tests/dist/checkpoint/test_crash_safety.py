"""A save killed with SIGKILL at a random point never costs the previous checkpoint (docs/design.md P5).

A child process saves checkpoints of a ~4 MB model in a loop; the test kills it at random moments, many
times, and after each kill checks that `latest` names a complete checkpoint whose files all verify (sha256).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from slipstream.checkpoint.atomic import read_latest, recover
from slipstream.checkpoint.reader import CheckpointReader

ROOT = Path(__file__).resolve().parents[3]
CHILD = """
import sys, torch, slipstream
from torch import nn
model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(16)])
config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 2}}
engine, *_ = slipstream.initialize(model=model, config=config)
engine.backward(engine(torch.randn(1, 256)).sum()); engine.step()
engine.save_checkpoint(sys.argv[1], tag="first")
print("ready", flush=True)
i = 0
while True:
    i += 1
    engine.save_checkpoint(sys.argv[1], tag=f"loop{i % 3}")
"""


def test_sigkill_during_save_never_breaks_latest(tmp_path: Path) -> None:
    save_dir = tmp_path / "ckpt"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(ROOT)
    rng = random.Random(0)
    seen_tags = set()
    for trial in range(6):
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(save_dir)], stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, env=env, text=True)
        try:
            assert child.stdout is not None
            lines: list[str] = []
            while "ready" not in lines and len(lines) < 50:  # log lines come first
                line = child.stdout.readline()
                if not line:
                    break
                lines.append(line.strip())
            assert "ready" in lines, f"trial {trial}: the child did not start: {lines}"
            time.sleep(rng.uniform(0.0, 0.6))
        finally:  # never leave a saving child behind
            child.send_signal(signal.SIGKILL)
            child.wait()
            child.stdout.close()  # type: ignore[union-attr]
        tag = read_latest(save_dir)
        assert tag is not None, f"trial {trial}: `latest` is missing"
        with CheckpointReader(save_dir / tag) as reader:  # verifies every file's size and sha256
            assert any(k.startswith("module/") for k in reader.keys())
        seen_tags.add(tag)
        recover(save_dir)
        assert not list(save_dir.glob(".tmp-*")), "recover() leaves no half-written directory"
    assert len(seen_tags) > 1, f"the kills never landed after a completed loop save: {seen_tags}"

"""Activation checkpointing: the activation memory it saves and the step time it costs, Slipstream against
DeepSpeed's `deepspeed.checkpointing.checkpoint` (peer environment), on a small transformer, one process.

    python bench/activation_checkpointing.py [--rounds 3] [--steps 5]

Activation memory is measured two ways at the end of the forward: the bytes autograd keeps at the outer level
(saved-tensor hooks: exact, but blind to what a checkpoint keeps inside its own frame, as selective
checkpointing does), and the process's RSS growth over the forward (what a user pays; the allocator makes it
coarser). Step time is the median forward + backward. Rows are run
interleaved, round by round, each in its own process; DeepSpeed's rows run in .bench-venv
(bash bench/make_peer_venv.sh) and are skipped, said so, when it is absent.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEER = Path(os.environ.get("BENCH_PEER_PYTHON", ROOT / ".bench-venv" / "bin" / "python"))
WIDTH, HEADS, SEQ, BATCH, BLOCKS = 256, 4, 256, 4, 6
ROWS = {"none": "slipstream", "slipstream": "slipstream", "slipstream_selective": "slipstream", "deepspeed": "peer"}


def _measure(row: str, steps: int) -> dict[str, float]:
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.n1, self.n2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
            self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
            self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)
            self.drop = nn.Dropout(0.1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, s, w = x.shape
            q, k, v = self.qkv(self.n1(x)).view(b, s, 3, HEADS, w // HEADS).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, w)
            x = x + self.drop(self.proj(a))
            return x + self.drop(self.down(F.gelu(self.up(self.n2(x)))))

    blocks = nn.ModuleList(Block() for _ in range(BLOCKS)).train()
    if row == "none":
        run = None
    elif row == "deepspeed":
        import deepspeed

        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29631")
        deepspeed.init_distributed(dist_backend="gloo")  # its checkpoint asks the comm layer for the rank
        deepspeed.checkpointing.configure(None)
        run = deepspeed.checkpointing.checkpoint
    else:
        from slipstream.activation import recompute

        run = recompute.selective_checkpoint if row == "slipstream_selective" else recompute.checkpoint
    x = torch.randn(BATCH, SEQ, WIDTH, requires_grad=True)

    def forward() -> torch.Tensor:
        h = x
        for block in blocks:
            h = block(h) if run is None else run(block, h)
        return h

    kept = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal kept
        kept += t.numel() * t.element_size()
        return t

    forward().sum().backward()  # warm: allocator pools, lazy inits
    blocks.zero_grad()
    x.grad = None
    before = _rss()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    grown = _rss() - before
    out.sum().backward()
    del out
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        forward().sum().backward()
        times.append(time.perf_counter() - started)
    return {"activation_bytes": kept, "rss_growth": grown, "step_s": statistics.median(times)}


def _rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--row", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.row:
        print(json.dumps(_measure(args.row, args.steps)))
        return 0
    rows = [r for r in ROWS if ROWS[r] == "slipstream" or PEER.exists()]
    if not PEER.exists():
        print(f"DeepSpeed row skipped: {PEER} is missing (bash bench/make_peer_venv.sh)")
    results: dict[str, list[dict[str, float]]] = {r: [] for r in rows}
    # Large blocks are mmapped and unmapped on free, so RSS follows live tensors instead of malloc's pools.
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT), "MALLOC_MMAP_THRESHOLD_": "65536"}
    for _ in range(args.rounds):
        for row in rows:
            python = str(PEER) if ROWS[row] == "peer" else sys.executable
            out = subprocess.run(
                [python, __file__, "--row", row, "--steps", str(args.steps)],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            results[row].append(json.loads(out.strip().splitlines()[-1]))
    base = results["none"]
    base_grown = statistics.median(r["rss_growth"] for r in base)
    base_time = statistics.median(r["step_s"] for r in base)
    print(f"{BLOCKS} blocks, width {WIDTH}, seq {SEQ}, batch {BATCH}, fp32; medians of {args.rounds} rounds")
    print(f"{'row':<22}{'kept MiB':>10}{'RSS growth MiB':>16}{'saved':>8}{'step ms':>10}{'overhead':>10}")
    overheads = {}
    for row in rows:
        kept = results[row][0]["activation_bytes"]
        grown = statistics.median(r["rss_growth"] for r in results[row])
        step = statistics.median(r["step_s"] for r in results[row])
        overheads[row] = step / base_time
        print(
            f"{row:<22}{kept / 2**20:>10.1f}{grown / 2**20:>16.1f}{1 - grown / base_grown:>8.1%}"
            f"{step * 1e3:>10.1f}{step / base_time:>9.2f}x"
        )
    if "deepspeed" in overheads:
        print(
            f"Slipstream / DeepSpeed step time with checkpointing: {overheads['slipstream'] / overheads['deepspeed']:.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

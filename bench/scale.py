"""ZeRO-Infinity on this machine: host memory against model size, and the largest model each system trains.

    python bench/scale.py [--sizes 25,50,100] [--rows torch,ss_cpu,ss_nvme,ds_nvme] [--nvme-dir DIR]
                          [--prove ROW] [--steps 3] [--peer-python .bench-venv/bin/python]

Owns the ZeRO-Infinity scale table. The model is decoder-shaped (token embedding, pre-norm blocks of
causal self-attention and a 4x MLP, an LM head; width `--width`), trained with fp32 Adam states on one rank (the figure is
per process; every row is a fresh process, so machine load does not change it). Rows:
    torch    plain torch AdamW in one process (the model, its gradients and Adam states all in memory)
    ss_cpu   Slipstream ZeRO-3, parameters and optimizer offloaded to the CPU, model built under zero.Init
    ss_nvme  Slipstream ZeRO-Infinity: parameters, optimizer and gradients on NVMe (`--nvme-dir`),
             `sub_group_size` 2e7 (the host holds a working set: gathered units, a few sub-groups); with
             SLIPSTREAM_NVME_GRADIENTS=memory in the environment the gradient shard stays in host memory
             (16 instead of 20 bytes per parameter on the disk: the larger model where the disk bounds it)
    ds_nvme  DeepSpeed's ZeRO-Infinity, the same config (peer environment, bench/make_peer_venv.sh)
For each row the peak RSS (ru_maxrss, less the RSS after imports) is measured at each size and fitted as
`fixed + bytes_per_param * N`; from the fit, the host's memory (MemTotal less a 2 GiB margin) and, for NVMe
rows, the disk's free space (the files' bytes per parameter), it prints the largest model that trains.
`--prove ROW` then trains `--steps` steps at that row's predicted largest size (or `--prove-params M`) and
checks that the loss is finite and the peak RSS stays under the host's memory.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARK = "@@scale "
ROWS = ["torch", "ss_cpu", "ss_nvme", "ds_nvme"]
VOCAB = 8192
SEQ = 64
MARGIN = 2 * 2**30
# fp32 parameter shard, master, gradient and two Adam moments, per parameter; 16 with SLIPSTREAM_NVME_GRADIENTS=memory
NVME_FILE_BYTES = 16 if os.environ.get("SLIPSTREAM_NVME_GRADIENTS", "").strip().lower() == "memory" else 20
SUB_GROUP = 20_000_000


def _rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def block_params(width: int) -> int:
    """Parameters of one block: two LayerNorms, qkv and output projections, the 4x MLP (with biases)."""
    return 4 * width + (3 * width * width + 3 * width) + (width * width + width) + 8 * width * width + 5 * width


def layers_for(params: float, width: int) -> int:
    return max(1, round((params - 2 * VOCAB * width - 2 * width) / block_params(width)))


def model_params(layers: int, width: int) -> int:
    return 2 * VOCAB * width + 2 * width + layers * block_params(width)


def build_model(layers: int, width: int, heads: int):
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, c = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, heads, c // heads).permute(2, 0, 3, 1, 4)
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
            x = x + self.proj(attn)
            return x + self.out(F.gelu(self.fc(self.ln2(x))))

    class Decoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, width)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.norm = nn.LayerNorm(width)
            self.head = nn.Linear(width, VOCAB, bias=False)

        def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            logits = self.head(self.norm(x))
            return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))

    return Decoder()


def ds_config(row: str, nvme_dir: str) -> dict:
    config: dict = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 3, "sub_group_size": SUB_GROUP},
    }
    zero = config["zero_optimization"]
    if row == "ss_cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
        zero["offload_param"] = {"device": "cpu", "pin_memory": False}
    else:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_dir, "pin_memory": False}
        zero["offload_param"] = {"device": "nvme", "nvme_path": nvme_dir, "pin_memory": False}
        config["aio"] = {"block_size": 1048576, "queue_depth": 16, "single_submit": False, "overlap_events": True}
    return config


def serve(args: argparse.Namespace) -> None:
    """One row at one size in this process; prints MARK + JSON."""
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = _rss_bytes()
    layers, width = args.layers, args.width
    heads = max(1, width // 64)
    if args.serve == "torch":
        model = build_model(layers, width, heads)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)

        def step(tokens: torch.Tensor, targets: torch.Tensor) -> float:
            loss = model(tokens, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
            return float(loss)
    else:
        os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"})
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29650 + os.getpid() % 200))
        if args.serve == "ds_nvme":
            import deepspeed as framework
        else:
            import slipstream as framework
        config = ds_config(args.serve, args.nvme_dir)
        with framework.zero.Init(config_dict_or_path=config):
            model = build_model(layers, width, heads)
        engine, *_ = framework.initialize(model=model, model_parameters=model.parameters(), config=config)

        def step(tokens: torch.Tensor, targets: torch.Tensor) -> float:
            loss = engine(tokens, targets)
            engine.backward(loss)
            engine.step()
            return float(loss)

    gen = torch.Generator().manual_seed(1)
    losses, times = [], []
    for _ in range(args.steps):
        tokens = torch.randint(0, VOCAB, (1, SEQ + 1), generator=gen)
        started = time.perf_counter()
        losses.append(step(tokens[:, :-1], tokens[:, 1:]))
        times.append(time.perf_counter() - started)
    print(MARK + json.dumps({"peak": _rss_bytes() - base, "losses": losses, "times": times}), flush=True)


def run_one(row: str, params: float, args: argparse.Namespace, python: str) -> dict | None:
    layers = layers_for(params, args.width)
    with tempfile.TemporaryDirectory(prefix="scale-", dir=args.nvme_dir) as nvme:
        cmd = [python, __file__, "--serve", row, "--layers", str(layers), "--width", str(args.width)]
        cmd += ["--steps", str(args.steps), "--nvme-dir", nvme]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu"}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
    if proc.returncode or not lines:
        print(f"{row} at {params / 1e6:.0f}M: failed (exit {proc.returncode})\n{proc.stderr[-3000:]}", file=sys.stderr)
        return None
    out = json.loads(lines[-1][len(MARK) :])
    out["params"] = model_params(layers, args.width)
    return out


def fit(points: list[tuple[int, int]]) -> tuple[float, float]:
    """Least squares `peak = fixed + per_param * params`."""
    n = len(points)
    mx = sum(p for p, _ in points) / n
    my = sum(b for _, b in points) / n
    sxx = sum((p - mx) ** 2 for p, _ in points)
    slope = sum((p - mx) * (b - my) for p, b in points) / sxx if sxx else 0.0
    return my - slope * mx, slope


def host_bytes() -> int:
    with open("/proc/meminfo") as handle:
        for line in handle:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def largest(row: str, fixed: float, per_param: float, nvme_dir: str) -> tuple[float, str]:
    """The largest parameter count the fit admits, and what bounds it."""
    limit = host_bytes() - MARGIN
    by_memory = (limit - fixed) / per_param if per_param > 0 else math.inf
    if row.endswith("nvme"):
        by_disk = shutil.disk_usage(nvme_dir).free * 0.95 / NVME_FILE_BYTES
        if by_disk < by_memory:
            return by_disk, "disk"
    return by_memory, "host memory"


def planner_largest(row: str, args: argparse.Namespace) -> float | None:
    """`slipstream plan --largest`'s answer for the row (the same width, config and limits as the fit's)."""
    from slipstream.planner.largest import largest

    config = None if row == "torch" else ds_config(row, args.nvme_dir)
    answers = largest(
        hidden=args.width,
        heads=max(1, args.width // 64),
        vocab=VOCAB,
        seq=SEQ,
        micro_batch=1,
        dtype="fp32",
        ds_config=config,
        host_memory=host_bytes() - MARGIN,
        nvme_free=int(shutil.disk_usage(args.nvme_dir).free * 0.95),
    )
    wanted = "zero0" if row == "torch" else "config"
    return next((float(a.params) for a in answers if a.option == wanted), None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="25,50,100", help="model sizes to measure, millions of parameters")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--nvme-dir", default=str(ROOT / ".scale-nvme"))
    parser.add_argument("--prove", default="", help="a row to train at its predicted largest size")
    parser.add_argument("--prove-params", type=float, default=0.0, help="millions of parameters for --prove")
    parser.add_argument("--peer-python", default=str(ROOT / ".bench-venv" / "bin" / "python"))
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args)
        return 0
    Path(args.nvme_dir).mkdir(parents=True, exist_ok=True)
    sizes = [float(s) * 1e6 for s in args.sizes.split(",") if s]
    rows = [r for r in args.rows.split(",") if r]
    print(
        f"decoder width {args.width}, vocab {VOCAB}, seq {SEQ}, 1 rank, fp32 Adam; host {host_bytes() / 2**30:.1f} GiB"
    )
    print(f"{'row':8} {'params':>9} {'peak MiB':>9} {'B/param':>8} {'s/step':>7}  loss")
    fits: dict[str, tuple[float, float]] = {}
    for row in rows:
        python = args.peer_python if row.startswith("ds_") else sys.executable
        if row.startswith("ds_") and not Path(python).exists():
            print(f"{row}: skipped (no peer environment at {python}; bench/make_peer_venv.sh)")
            continue
        points = []
        for size in sizes:
            out = run_one(row, size, args, python)
            if out is None:
                continue
            points.append((out["params"], out["peak"]))
            print(
                f"{row:8} {out['params'] / 1e6:8.1f}M {out['peak'] / 2**20:9.0f} {out['peak'] / out['params']:8.1f} "
                f"{min(out['times']):7.2f}  {out['losses'][-1]:.4f}"
            )
        if len(points) >= 2:
            fits[row] = fit(points)
    print("\nfit: peak RSS = fixed + bytes/param x N; largest model within the host's memory and the disk;")
    print("plan: `slipstream plan --largest` for the same width, config and limits (ds_nvme: Slipstream's plan)")
    print(
        f"{'row':8} {'fixed MiB':>9} {'B/param':>8} {'largest':>9}  {'bound':11} {'vs torch':>8} {'plan':>8} {'plan/fit':>8}"
    )
    largest_of = {}
    for row, (fixed, per_param) in fits.items():
        count, bound = largest(row, fixed, per_param, args.nvme_dir)
        largest_of[row] = count
        ratio = count / largest_of["torch"] if "torch" in largest_of else float("nan")
        planned = None if row.startswith("ds_") else planner_largest(row, args)
        plan_text = f"{planned / 1e9:7.2f}B {planned / count:8.2f}" if planned else f"{'-':>8} {'-':>8}"
        print(
            f"{row:8} {fixed / 2**20:9.0f} {per_param:8.2f} {count / 1e9:8.2f}B  {bound:11} {ratio:7.2f}x {plan_text}"
        )
    if args.prove:
        target = args.prove_params * 1e6 if args.prove_params else largest_of.get(args.prove, 0.0)
        if not target:
            print(f"--prove {args.prove}: no fit for that row (measure it with --rows)", file=sys.stderr)
            return 2
        python = args.peer_python if args.prove.startswith("ds_") else sys.executable
        out = run_one(args.prove, target, args, python)
        if out is None:
            return 1
        ok = all(math.isfinite(x) for x in out["losses"]) and out["peak"] < host_bytes()
        print(
            f"\nprove {args.prove}: {out['params'] / 1e9:.2f}B parameters, {len(out['losses'])} steps, losses "
            f"{[round(x, 4) for x in out['losses']]}, peak RSS {out['peak'] / 2**30:.2f} GiB, "
            f"{min(out['times']):.1f} s/step: {'OK' if ok else 'FAILED'}"
        )
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Precision options side by side: step time and model-state bytes at ZeRO 2 and 3 (2 ranks, gloo).

    python bench/precision.py [--quick] [--layers 8] [--width 1024] [--steps 6] [--stages 2,3]
                              [--rows fp32,bf16,autocast,bf16_masters]

Rows: `fp32` (fp32 parameters and masters), `bf16` (bf16 parameters, fp32 masters), `autocast`
(`torch_autocast` bf16: fp32 parameters, bf16 compute), `bf16_masters` (`bf16_master_weights_and_grads` +
`bf16_optimizer_states`: no fp32 copy, bf16 Adam moments). The model is a stack of Linear(width, width) + ReLU
layers trained with AdamW. Model-state bytes are what the engine holds per rank (parameters or their shard,
masters, gradients, optimizer state: `engine.optimizer.owned_bytes()` plus the optimizer's state tensors);
step time is the median over `--steps` steps after two warm-up steps. Printed per stage: each row's figures and
its ratios to the fp32 row of the same stage (same run, same machine load). All rows run in one pair of rank
processes, one after the other.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from _two_ranks import make_mlp, run_two_ranks

ROOT = Path(__file__).resolve().parent.parent
ROWS = {
    "fp32": {},
    "bf16": {"bf16": {"enabled": True}},
    "autocast": {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}},
    "bf16_masters": {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}},
}
MICRO_BATCH = 16


def model_state_bytes(engine: object) -> int:
    zero = engine.optimizer  # type: ignore[attr-defined]
    owned = zero.owned_bytes()
    states = sum(
        t.numel() * t.element_size()
        for s in zero.optimizer.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )
    return sum(owned.get(k, 0) for k in ("params", "master", "grads", "offloaded_params")) + states


def run_row(row: str, stage: int, args: argparse.Namespace) -> dict[str, float]:
    import slipstream

    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": stage},
        **ROWS[row],
    }
    engine, _, _, _ = slipstream.initialize(model=make_mlp(args.layers, args.width), config=config)
    gen = torch.Generator().manual_seed(dist.get_rank())
    times = []
    for step in range(args.steps + 2):
        x = torch.randn(MICRO_BATCH, args.width, generator=gen)
        started = time.perf_counter()
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        if step >= 2:
            times.append(time.perf_counter() - started)
    result = {
        "step_s": statistics.median(times),
        "bytes": float(model_state_bytes(engine)),
        "loss": float(loss.detach()),
    }
    engine.destroy()
    dist.barrier()
    return result


def measure(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Every row at every stage, one after the other, on this rank (bench/_two_ranks.py runs it on both)."""
    return {f"{stage}:{row}": run_row(row, stage, args) for stage in args.stages for row in args.rows}


def report(results: dict[str, dict[str, float]], args: argparse.Namespace) -> None:
    print(f"precision: {args.layers} x Linear({args.width}, {args.width}), micro batch {MICRO_BATCH}, 2 ranks, gloo")
    print(f"{'stage':>5} {'row':<14} {'step ms':>9} {'states MiB':>11} {'time/fp32':>10} {'bytes/fp32':>11}")
    for stage in args.stages:
        base = results[f"{stage}:fp32"] if "fp32" in args.rows else None
        for row in args.rows:
            r = results[f"{stage}:{row}"]
            t = f"{r['step_s'] / base['step_s']:.2f}x" if base else "-"
            b = f"{r['bytes'] / base['bytes']:.2f}x" if base else "-"
            print(f"{stage:>5} {row:<14} {r['step_s'] * 1e3:>9.1f} {r['bytes'] / 2**20:>11.2f} {t:>10} {b:>11}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 small layers, 2 steps: a smoke run")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--stages", default="2,3")
    parser.add_argument("--rows", default=",".join(ROWS))
    args = parser.parse_args()
    args.stages = [int(s) for s in args.stages.split(",")]
    args.rows = [r for r in args.rows.split(",") if r]
    unknown = sorted(set(args.rows) - set(ROWS))
    if unknown:
        sys.exit(f"--rows: unknown {unknown}; choose from {sorted(ROWS)}")
    if args.quick:
        args.layers, args.width, args.steps = 2, 128, 2
    sys.path.insert(0, str(ROOT))
    report(run_two_ranks(measure, args), args)


if __name__ == "__main__":
    main()

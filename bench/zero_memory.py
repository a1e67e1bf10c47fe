"""Peak memory of ZeRO stages 1 and 2 on a wide MLP, Slipstream against DeepSpeed, at every precision and with
CPU offload.

    python bench/zero_memory.py [--quick] [--layers 48] [--width 1024] [--steps 4] [--rows fp32,bf16,fp16,offload]
                                [--stages 1,2] [--no-deepspeed] [--peer-python .bench-venv/bin/python]

Owns the ZeRO memory table ("stage 2 must be lighter than stage 1"). The model is a stack of
`--layers` Linear(width, width) layers with ReLU (48 x 1024: 50.4M parameters), trained with AdamW and
DeepSpeed's default `reduce_bucket_size` (5e8 elements: the whole model is one bucket) on 2 ranks (gloo, one
thread each). Every row is a fresh pair of processes, so each peak RSS (the ranks' `ru_maxrss`, the larger of
the two) belongs to that row alone; machine load does not change it. Printed per precision: stage 1 and stage
2 peaks of both frameworks, stage 2 / stage 1 and Slipstream / DeepSpeed at stage 2 (targets: <= 1.0 and
<= 0.9), and the losses of the last step (the same data and seed, so they agree).
DeepSpeed runs in the peer environment (bench/make_peer_venv.sh); its rows are skipped when that is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MARK = "@@zero_memory "
PRECISIONS = {
    "fp32": {},
    "bf16": {"bf16": {"enabled": True}},
    "fp16": {"fp16": {"enabled": True, "initial_scale_power": 8}},
    "offload": {},
}


def config(row: str, stage: int, micro_batch: int) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage}  # reduce_bucket_size: DeepSpeed's default, 5e8
    if row == "offload":
        zero["offload_optimizer"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
        "steps_per_print": 1_000_000,
        **PRECISIONS[row],
    }


def rank_main(args: argparse.Namespace) -> None:
    """One rank of one row: build, train `steps` steps, report the RSS high-water mark and the last loss."""
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", store=dist.FileStore(args.store, 2), rank=rank, world_size=2)
    framework, row, stage = args.framework, args.row, args.stage
    if framework == "deepspeed":
        import logging

        import deepspeed as ds  # type: ignore[import-not-found]

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    else:
        import slipstream as ds
    torch.manual_seed(1234)
    layers: list[nn.Module] = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width), nn.ReLU()]
    model = nn.Sequential(*layers)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    engine, _, _, _ = ds.initialize(
        model=model, model_parameters=model.parameters(), config=config(row, stage, args.micro_batch)
    )
    generator = torch.Generator().manual_seed(99 + rank)
    loss_value = float("nan")
    for _ in range(args.steps):
        x = torch.randn(args.micro_batch, args.width, generator=generator)
        y = torch.randn(args.micro_batch, args.width, generator=generator)
        dtype = next(engine.module.parameters()).dtype
        out = engine(x.to(dtype))
        loss = torch.nn.functional.mse_loss(out.float(), y)
        engine.backward(loss)
        engine.step()
        loss_value = float(loss)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    figures: list[Any] = [None, None]
    dist.all_gather_object(figures, (peak, rss_before, loss_value))
    if rank == 0:
        print(MARK + json.dumps(figures), flush=True)
    dist.destroy_process_group()


def run_row(python: Path, framework: str, row: str, stage: int, args: argparse.Namespace) -> dict[str, Any] | None:
    with tempfile.TemporaryDirectory(prefix="zero_memory_") as tmp:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533"}
        if framework == "deepspeed":
            env["PYTHONPATH"] = ""
        cmd = [
            str(python),
            __file__,
            "--rank-main",
            "--framework",
            framework,
            "--row",
            row,
            "--stage",
            str(stage),
            "--store",
            str(Path(tmp) / "store"),
            "--layers",
            str(args.layers),
            "--width",
            str(args.width),
            "--steps",
            str(args.steps),
            "--micro-batch",
            str(args.micro_batch),
        ]
        procs = [
            subprocess.Popen(
                cmd,
                env={**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2"},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                cwd=ROOT,
            )
            for r in range(2)
        ]
        outs = [p.communicate()[0] for p in procs]
    for line in outs[0].splitlines():
        if line.startswith(MARK):
            figures = json.loads(line[len(MARK) :])
            return {"peak": max(f[0] for f in figures), "before": max(f[1] for f in figures), "loss": figures[0][2]}
    print(f"  {framework} {row} stage {stage} failed:\n" + "\n".join(outs[0].splitlines()[-15:]), flush=True)
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 8 x 256 layers, 2 steps, fp32 only")
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=64)
    parser.add_argument("--rows", default="fp32,bf16,fp16,offload")
    parser.add_argument("--stages", default="1,2")
    parser.add_argument("--no-deepspeed", action="store_true")
    parser.add_argument("--peer-python", type=Path, default=ROOT / ".bench-venv" / "bin" / "python")
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--framework", help=argparse.SUPPRESS)
    parser.add_argument("--row", help=argparse.SUPPRESS)
    parser.add_argument("--stage", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        rank_main(args)
        return 0
    if args.quick:
        args.layers, args.width, args.steps, args.rows = 8, 256, 2, "fp32"
    frameworks = {"slipstream": Path(sys.executable)}
    if not args.no_deepspeed and args.peer_python.exists():
        frameworks["deepspeed"] = args.peer_python
    elif not args.no_deepspeed:
        print(f"note: no DeepSpeed peer at {args.peer_python}; `bash bench/make_peer_venv.sh` adds those rows")
    params = args.layers * args.width * (args.width + 1)
    print(
        f"MLP {args.layers} x Linear({args.width}, {args.width}): {params / 1e6:.1f}M parameters, 2 ranks (gloo), "
        f"AdamW, reduce_bucket_size 5e8 (default), micro batch {args.micro_batch}, {args.steps} steps; "
        f"peak RSS MiB per rank (max of the ranks); load {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    started = time.perf_counter()
    stages = [int(s) for s in args.stages.split(",")]
    result: dict[tuple[str, str, int], dict[str, Any] | None] = {}
    for row in args.rows.split(","):
        for stage in stages:
            for framework, python in frameworks.items():
                result[(framework, row, stage)] = run_row(python, framework, row, stage, args)

    def peak(framework: str, row: str, stage: int) -> float | None:
        figures = result.get((framework, row, stage))
        return None if figures is None else figures["peak"]

    def fmt(value: float | None, spec: str = ".0f") -> str:
        return "-" if value is None else format(value, spec)

    def ratio(a: float | None, b: float | None) -> str:
        return "-" if a is None or b is None else f"{a / b:.2f}x"

    header = (
        f"{'row':<8} | {'SS st1':>7} | {'SS st2':>7} | {'DS st1':>7} | {'DS st2':>7} | {'SS2/SS1':>7} | "
        f"{'SS2/DS2':>7} | {'SS1/DS1':>7} | last loss SS1 / SS2 / DS2"
    )
    print(header + "\n" + "-" * len(header))
    for row in args.rows.split(","):
        s1, s2 = peak("slipstream", row, 1), peak("slipstream", row, 2)
        d1, d2 = peak("deepspeed", row, 1), peak("deepspeed", row, 2)
        losses = " / ".join(
            fmt((result.get((f, row, s)) or {}).get("loss"), ".5f")
            for f, s in (("slipstream", 1), ("slipstream", 2), ("deepspeed", 2))
        )
        print(
            f"{row:<8} | {fmt(s1):>7} | {fmt(s2):>7} | {fmt(d1):>7} | {fmt(d2):>7} | {ratio(s2, s1):>7} | "
            f"{ratio(s2, d2):>7} | {ratio(s1, d1):>7} | {losses}"
        )
    print(f"\nbenchmark wall time {time.perf_counter() - started:.0f} s, load {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

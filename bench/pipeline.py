"""Pipeline parallelism: samples/s and peak RSS per rank for an 8-block MLP (67M parameters, fp32 AdamW) at
2 stages and 8 micro-batches, Slipstream's schedules against plain torch.distributed.pipelining 1F1B and
DeepSpeed's PipelineEngine (peer environment), next to one process running the same micro-batches.

    python bench/pipeline.py [--quick] [--rows single,torch_1f1b,ss_1f1b,...] [--peer-python PATH]

Each row is a fresh group of processes (gloo, FileStore, one thread each) that runs `--warmup` batches, then
times `--batches` batches; it reports the median batch time, samples/s, and the peak RSS of each rank over
its RSS after the model was built (so the rows share the same baseline: torch and the framework loaded).
`--repeat N` cycles through the rows N times and keeps each row's fastest run (the machine is shared).
DeepSpeed's row runs this same file under the peer Python (`.bench-venv`, bench/make_peer_venv.sh) and is
skipped when that is missing. Ratios are against the torch 1F1B row.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROWS = ["single", "torch_1f1b", "ss_1f1b", "ss_interleaved_1f1b", "ss_zbv_zero_bubble", "deepspeed"]
REPO = Path(__file__).resolve().parents[1]


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _torch_modules(width: int, blocks: int):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, width: int = width) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(width, width), nn.Linear(width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(torch.relu(self.up(x)))

    return Block, [Block() for _ in range(blocks)] if blocks else []


def _data(args: argparse.Namespace, step: int):
    import torch

    gen = torch.Generator().manual_seed(step)
    return [
        (torch.randn(args.micro, args.width, generator=gen), torch.randn(args.micro, args.width, generator=gen))
        for _ in range(args.micros)
    ]


def _serve(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    os.environ.update(
        {
            "RANK": str(args.rank),
            "LOCAL_RANK": str(args.rank),
            "WORLD_SIZE": str(args.world),
            "LOCAL_WORLD_SIZE": str(args.world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(args.port),
        }
    )
    torch.set_num_threads(1)
    if args.world > 1:
        dist.init_process_group(
            "gloo",
            store=dist.FileStore(args.store, args.world),
            rank=args.rank,
            world_size=args.world,
            timeout=timedelta(minutes=10),
        )
    torch.manual_seed(0)
    Block, _ = _torch_modules(args.width, 0)
    row = args.serve
    if row == "single":
        model = torch.nn.Sequential(*[Block() for _ in range(args.blocks)])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(batch: list) -> float:
            total = 0.0
            for x, y in batch:
                loss = F.mse_loss(model(x), y) / len(batch)
                loss.backward()
                total += float(loss)
            optimizer.step()
            optimizer.zero_grad()
            return total
    elif row == "torch_1f1b":
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        half = args.blocks // 2
        part = torch.nn.Sequential(*[Block() for _ in range(half)])
        stage = PipelineStage(part, args.rank, 2, torch.device("cpu"))
        optimizer = torch.optim.AdamW(part.parameters(), lr=1e-4)
        schedule = Schedule1F1B(stage, args.micros, loss_fn=F.mse_loss)

        def step(batch: list) -> float:
            xs = torch.cat([x for x, _ in batch])
            ys = torch.cat([y for _, y in batch])
            losses: list = []
            if args.rank == 0:
                schedule.step(xs)
            else:
                schedule.step(target=ys, losses=losses)
            optimizer.step()
            optimizer.zero_grad()
            return float(sum(losses)) / args.micros if losses else 0.0
    elif row == "deepspeed":
        import logging

        import deepspeed
        from deepspeed.pipe import LayerSpec, PipelineModule

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        deepspeed.init_distributed(dist_backend="gloo")  # adopts the group created above
        module = PipelineModule(
            [LayerSpec(Block) for _ in range(args.blocks)], num_stages=2, loss_fn=F.mse_loss, partition_method="uniform"
        )
        engine, *_ = deepspeed.initialize(model=module, model_parameters=module.parameters(), config=_ds_config(args))

        def step(batch: list) -> float:
            return float(engine.train_batch(iter(batch)))
    else:
        import slipstream
        from slipstream.pipe import LayerSpec, PipelineModule

        module = PipelineModule(
            [LayerSpec(Block) for _ in range(args.blocks)],
            num_stages=2,
            loss_fn=F.mse_loss,
            partition_method="uniform",
            schedule=row.removeprefix("ss_"),
            dynamic_shape=False,
        )
        engine, *_ = slipstream.initialize(model=module, config=_ds_config(args))

        def step(batch: list) -> float:
            return float(engine.train_batch(iter(batch)))

    base = _rss_mib()
    times = []
    for i in range(args.warmup + args.batches):
        batch = _data(args, i)
        started = time.perf_counter()
        step(batch)
        if i >= args.warmup:
            times.append(time.perf_counter() - started)
    Path(args.out).write_text(json.dumps({"times": times, "peak_mib": _rss_mib() - base, "base_mib": base}))
    if args.world > 1:
        dist.barrier()
        dist.destroy_process_group()


def _ds_config(args: argparse.Namespace) -> dict:
    return {
        "train_micro_batch_size_per_gpu": args.micro,
        "gradient_accumulation_steps": args.micros,
        "train_batch_size": args.micro * args.micros,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 0},
    }


def _run_row(row: str, args: argparse.Namespace, python: str) -> dict | None:
    world = 1 if row == "single" else 2
    with tempfile.TemporaryDirectory(prefix="pipe-bench-") as tmp:
        procs = []
        for rank in range(world):
            cmd = [
                python,
                str(Path(__file__).resolve()),
                "--serve",
                row,
                "--rank",
                str(rank),
                "--world",
                str(world),
                "--store",
                f"{tmp}/store",
                "--out",
                f"{tmp}/out{rank}.json",
                "--port",
                str(29700 + rank),
            ]
            cmd += [f"--{k}={getattr(args, k)}" for k in ("width", "blocks", "micro", "micros", "warmup", "batches")]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu"}
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        errors = [p.communicate()[1] for p in procs]
        if any(p.returncode for p in procs):
            print(f"{row}: failed\n" + "\n".join(e[-2000:] for e in errors if e), file=sys.stderr)
            return None
        results = [json.loads(Path(f"{tmp}/out{r}.json").read_text()) for r in range(world)]
    batch = statistics.median(max(r["times"][i] for r in results) for i in range(args.batches))
    return {
        "batch_s": batch,
        "samples_s": args.micro * args.micros / batch,
        "peak_mib": [round(r["peak_mib"]) for r in results],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small model and 2 batches (smoke run)")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument(
        "--peer-python", default=os.environ.get("BENCH_PEER_PYTHON", str(REPO / ".bench-venv/bin/python"))
    )
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--micros", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batches", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=1, help="cycle through the rows N times, keep each row's best")
    parser.add_argument("--serve"), parser.add_argument("--rank", type=int), parser.add_argument("--world", type=int)
    parser.add_argument("--store"), parser.add_argument("--out"), parser.add_argument("--port", type=int)
    args = parser.parse_args()
    if args.serve:
        _serve(args)
        return
    if args.quick:
        args.width, args.warmup, args.batches = 256, 1, 2
    params = args.blocks * 2 * (args.width * args.width + args.width)
    print(
        f"MLP {args.blocks} blocks x width {args.width} ({params / 1e6:.1f}M params), micro-batch {args.micro}, "
        f"{args.micros} micro-batches, 2 stages (gloo, 1 thread per rank)"
    )
    results: dict[str, dict | None] = {}
    for _ in range(args.repeat):  # on a shared machine the best of several cycles is the least disturbed
        for row in args.rows.split(","):
            python = args.peer_python if row == "deepspeed" else sys.executable
            if row == "deepspeed" and not Path(python).exists():
                print(f"{row}: skipped ({python} missing; bash bench/make_peer_venv.sh)")
                continue
            got = _run_row(row, args, python)
            best = results.get(row)
            if got is not None and (best is None or got["batch_s"] < best["batch_s"]):
                results[row] = got
            results.setdefault(row, got)
    ref = (results.get("torch_1f1b") or {}).get("batch_s")
    print(f"{'row':<22} {'batch s':>8} {'samples/s':>10} {'time vs torch 1F1B':>19} {'peak MiB/rank':>16}")
    for row, r in results.items():
        if r is None:
            continue
        ratio = f"{r['batch_s'] / ref:.2f}x" if ref else "-"
        print(f"{row:<22} {r['batch_s']:>8.3f} {r['samples_s']:>10.1f} {ratio:>19} {str(r['peak_mib']):>16}")


if __name__ == "__main__":
    main()

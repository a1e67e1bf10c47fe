"""Step time of LAMB against AdamW and of Muon against AdamW at ZeRO-2 on 2 ranks (gloo), and optimizer-state
bytes as the planner predicts them against what the engine holds.

    .venv/bin/python bench/optimizers.py [--width 512] [--layers 6] [--steps 20] [--stage 2] [--offload]
                                         [--optimizers adamw,lamb,muon]
    .venv/bin/python bench/optimizers.py --memory [--offload]
    .venv/bin/python bench/optimizers.py --step-only [--steps 200]

Each rank builds one engine per optimizer on the same stack of wide layers, then the engines take turns in
chunks of a few steps (so drift in machine load hits all of them alike); a step's time is the slowest rank's.
Prints each optimizer's median step time, the ratios LAMB / AdamW and Muon / AdamW, and per optimizer the
planner's optimizer-state bytes per rank, the engine's (`owned_bytes()` after a step) and their ratio.
`--offload` puts the optimizer on the host (offload_optimizer.device cpu). `--memory` instead runs each optimizer
in a fresh pair of processes and prints the growth of the peak RSS over the RSS before the engine was built,
slipstream already imported (the larger of the two ranks; on CPU that is where the engine's states and
temporaries live). `--step-only` times the optimizer's `step()` alone in one process and one thread, LAMB
against AdamW on rank 0's ZeRO-2 piece of the model (the kernels and their Python, no collective). DeepSpeed's
FusedLamb is
a CUDA op: on this CPU machine constructing it raises "This op had not been implemented on CPU backend", so there
is no peer row; DeepSpeed's Muon needs ZeRO on a GPU, likewise.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

OPTIMIZERS = {
    "adamw": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
    "lamb": {"type": "Lamb", "params": {"lr": 1e-3, "weight_decay": 0.01}},
    "muon": {"type": "Muon", "params": {"muon_lr": 0.02, "adam_lr": 1e-3, "weight_decay": 0.01}},
}
CHUNK = 5


def wide_stack(width: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(m for _ in range(layers) for m in (nn.Linear(width, width), nn.GELU())))


def build(name: str, args: argparse.Namespace, world: int) -> object:
    import slipstream

    zero: dict = {"stage": args.stage}
    if args.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {
        "train_batch_size": 8 * world,
        "train_micro_batch_size_per_gpu": 8,
        "gradient_clipping": 1.0,
        "optimizer": OPTIMIZERS[name],
        "zero_optimization": zero,
    }
    engine, *_ = slipstream.initialize(model=wide_stack(args.width, args.layers), config=config)
    return engine


def step(engine: object, batch: torch.Tensor) -> None:
    engine.backward(engine(batch).square().mean())  # type: ignore[attr-defined]
    engine.step()  # type: ignore[attr-defined]


def state_bytes(engine: object, world: int) -> tuple[int, int]:
    """(planner's optimizer-state bytes per rank, the engine's)."""
    from slipstream.planner.engine_hooks import engine_estimate

    planned = engine_estimate(plan=engine.plan, model=engine.module, world_size=world)  # type: ignore[attr-defined]
    return planned.owned["optimizer_state"], engine.optimizer.owned_bytes()["optimizer_state"]  # type: ignore[attr-defined]


def rank_main(rank: int, world: int, args: argparse.Namespace, store_path: str, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=600))
    engines = {name: build(name, args, world) for name in args.optimizers}
    batch = torch.randn(8, args.width, generator=torch.Generator().manual_seed(rank))
    times: dict[str, list[float]] = {name: [] for name in args.optimizers}
    for engine in engines.values():  # warm up: states allocated, first-touch page faults paid
        step(engine, batch)
    for _ in range(max(1, args.steps // CHUNK)):
        for name, engine in engines.items():
            for _ in range(CHUNK):
                dist.barrier()
                start = time.perf_counter()
                step(engine, batch)
                took = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                times[name].append(float(took))
    sizes = {name: state_bytes(engine, world) for name, engine in engines.items()}
    if rank == 0:
        torch.save({"times": times, "sizes": sizes}, out)
    dist.barrier()
    dist.destroy_process_group()


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def memory_main(rank: int, world: int, args: argparse.Namespace, name: str, store_path: str, out: str) -> None:
    """One optimizer in a fresh pair: (peak RSS - RSS before the engine) after `args.steps` steps, MiB."""
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    import slipstream  # noqa: F401  (its import is not the engine's memory)

    model_bytes = sum(p.numel() * 4 for p in wide_stack(args.width, args.layers).parameters())
    before = _rss_mib()
    engine = build(name, args, world)
    batch = torch.randn(8, args.width, generator=torch.Generator().manual_seed(rank))
    for _ in range(args.steps):
        step(engine, batch)
    grown = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before])
    dist.all_reduce(grown, op=dist.ReduceOp.MAX)
    if rank == 0:
        torch.save({"grown": float(grown), "model_mib": model_bytes / 2**20}, out)
    dist.destroy_process_group()


def report_memory(args: argparse.Namespace, world: int) -> None:
    where = "offload_optimizer cpu" if args.offload else "on the device"
    print(f"ZeRO-{args.stage} ({where}), {world} ranks, {args.layers} x Linear({args.width}): peak RSS growth, MiB")
    for name in args.optimizers:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.pt")
            mp.spawn(memory_main, args=(world, args, name, os.path.join(tmp, "store"), out), nprocs=world)
            result = torch.load(out)
        print(f"  {name:6s} {result['grown']:8.1f}  (fp32 model: {result['model_mib']:.1f})")


def report_step_only(args: argparse.Namespace) -> None:
    """LAMB's and AdamW's `step()` alone, one process and one thread, on rank 0's ZeRO-2 piece of the model: a flat
    fp32 tensor holding the first half of the parameters, LAMB with the whole-tensor map of the parts in it (no
    collective: the norms' all-reduce is left out)."""
    from slipstream.ops.adam import FusedAdam
    from slipstream.optim.lamb import FusedLamb
    from slipstream.zero.whole_tensors import TensorPart, WholeTensorMap

    torch.set_num_threads(1)
    sizes = [p.numel() for p in wide_stack(args.width, args.layers).parameters()]
    half, parts = sum(sizes) // 2, []
    for number, size in enumerate(sizes):
        offset = sum(part.numel for part in parts)
        if offset < half:
            parts.append(TensorPart(tensor=number, offset=offset, numel=min(size, half - offset), lo=0))
    gen = torch.Generator().manual_seed(0)
    pieces = [nn.Parameter(torch.randn(half, generator=gen)) for _ in range(2)]
    for piece in pieces:
        piece.grad = torch.randn(half, generator=gen) * 1e-3
    lamb = FusedLamb([pieces[1]], lr=1e-3, weight_decay=0.01)
    whole = WholeTensorMap(
        shapes=tuple((s,) for s in sizes), group_of=(0,) * len(sizes), parts_of={id(pieces[1]): tuple(parts)},
        split=frozenset(),
    )  # fmt: skip
    lamb.attach_whole_tensors(whole)
    optimizers = {"adamw": FusedAdam([pieces[0]], lr=1e-3, weight_decay=0.01), "lamb": lamb}
    times: dict[str, list[float]] = {name: [] for name in optimizers}
    for optimizer in optimizers.values():
        optimizer.step()  # warm up: states allocated, the op loaded
    for _ in range(max(1, args.steps // CHUNK)):
        for name, optimizer in optimizers.items():
            for _ in range(CHUNK):
                start = time.perf_counter()
                optimizer.step()
                times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(values) for name, values in times.items()}
    print(f"optimizer step alone, 1 thread, rank 0's ZeRO-2 piece ({half:,} fp32 elements, {len(parts)} parts)")
    for name, seconds in median.items():
        print(f"  {name:6s} step {seconds * 1e3:8.3f} ms (median of {len(times[name])})")
    print(f"  ratio lamb / adamw  {median['lamb'] / median['adamw']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--offload", action="store_true", help="offload_optimizer.device cpu")
    parser.add_argument("--memory", action="store_true", help="peak RSS per optimizer, fresh processes each")
    parser.add_argument(
        "--optimizers", type=lambda text: text.split(","), default=list(OPTIMIZERS), help="e.g. adamw,lamb"
    )
    parser.add_argument("--step-only", action="store_true", help="LAMB's and AdamW's step() alone, one process")
    args = parser.parse_args()
    unknown = sorted(set(args.optimizers) - set(OPTIMIZERS))
    if unknown:
        parser.error(f"--optimizers {unknown} unknown; choose from {','.join(OPTIMIZERS)}")
    world = 2
    if args.step_only:
        report_step_only(args)
        return
    if args.memory:
        report_memory(args, world)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        mp.spawn(rank_main, args=(world, args, os.path.join(tmp, "store"), out), nprocs=world)
        result = torch.load(out)
    median = {name: statistics.median(values) for name, values in result["times"].items()}
    params = sum(p.numel() for p in wide_stack(args.width, args.layers).parameters())
    offload = " with offload_optimizer cpu" if args.offload else ""
    print(f"ZeRO-{args.stage}{offload}, {world} ranks (gloo), {args.layers} x Linear({args.width}), {params:,} params")
    for name, seconds in median.items():
        print(f"  {name:6s} step {seconds * 1e3:8.2f} ms (median of {len(result['times'][name])})")
    for name in ("lamb", "muon"):
        if name in median and "adamw" in median:
            print(f"  ratio {name} / adamw  {median[name] / median['adamw']:.2f}x")
    print("  optimizer-state bytes per rank: planner, engine, planner / engine")
    for name, (planned, held) in result["sizes"].items():
        print(f"  {name:6s} {planned:>12,} {held:>12,}  {planned / max(held, 1):.2f}x")


if __name__ == "__main__":
    main()

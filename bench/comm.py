"""Communication: step time with `overlap_comm` off and on at ZeRO 2 and 3, the bytes one step puts on the wire
per `communication_data_type`, and stage 3's all-gather bytes with `zero_quantized_weights` (2 ranks, gloo);
then ZeRO++'s bytes inside and across "nodes" at 4 ranks as 2 x 2 (bench/_zeropp_bytes.py).

    python bench/comm.py [--quick] [--layers 8] [--width 1024] [--steps 6] [--rounds 3] [--stages 2,3]
                         [--zeropp-layers 48] [--zeropp-only]

The model is a stack of Linear(width, width) + ReLU layers trained with AdamW; `reduce_bucket_size` is one
layer's weight, so several gradient buckets (stage 2) or units (stage 3) are reduced per step. Every engine
is built once in the same pair of rank processes; the rounds alternate between them (`--steps` steps each,
the median step of the slowest rank counted), so drift in machine load hits all of them alike. Printed: each
row's step time and its ratio to overlap off at the same stage, then the bytes of gradient reductions one
step issues per dtype (stage 2) and their ratio to fp32, then the bytes of stage 3's parameter all-gathers in
one step, exact and quantized (qwZ).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import _zeropp_bytes
import torch
import torch.distributed as dist
from _two_ranks import make_mlp, run_two_ranks

ROOT = Path(__file__).resolve().parent.parent

MICRO_BATCH = 16
DTYPES = ("fp32", "bf16", "fp16")


def make_engine(stage: int, args: argparse.Namespace, **extra: object) -> object:
    import slipstream

    zero = {"stage": stage, "stage3_param_persistence_threshold": 0, **extra.pop("zero", {})}  # type: ignore[dict-item]
    if stage < 3:  # at stage 3 each unit is reduced whole (reduce_bucket_size is reported there)
        zero["reduce_bucket_size"] = args.width * args.width
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": zero,
        **extra,
    }
    engine, _, _, _ = slipstream.initialize(model=make_mlp(args.layers, args.width), config=config)
    return engine


def train(engine: object, steps: int, width: int, gen: torch.Generator) -> list[float]:
    """Seconds of each step, the slowest rank's."""
    times = []
    for _ in range(steps):
        x = torch.randn(MICRO_BATCH, width, generator=gen)
        dist.barrier()
        started = time.perf_counter()
        engine.backward(engine(x).float().pow(2).mean())  # type: ignore[attr-defined]
        engine.step()  # type: ignore[attr-defined]
        took = torch.tensor([time.perf_counter() - started])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        times.append(float(took))
    return times


def overlap_rows(args: argparse.Namespace, gen: torch.Generator) -> dict[str, float]:
    engines = {
        f"{stage}:{'on' if on else 'off'}": make_engine(stage, args, zero={"overlap_comm": on})
        for stage in args.stages
        for on in (False, True)
    }
    times: dict[str, list[float]] = {name: [] for name in engines}
    for engine in engines.values():
        train(engine, 2, args.width, gen)  # warm-up
    for _ in range(args.rounds):
        for name, engine in engines.items():
            times[name] += train(engine, args.steps, args.width, gen)
    for engine in engines.values():
        engine.destroy()  # type: ignore[attr-defined]
    return {name: statistics.median(t) for name, t in times.items()}


def wire_bytes(args: argparse.Namespace, gen: torch.Generator) -> dict[str, float]:
    from slipstream.comm import count_collectives

    out = {}
    for dtype in DTYPES:
        engine = make_engine(2, args, communication_data_type=dtype)
        with count_collectives() as counter:
            train(engine, 1, args.width, gen)
        out[dtype] = float(counter.bytes["reduce_scatter"])
        engine.destroy()  # type: ignore[attr-defined]
    for quantized in (False, True):
        engine = make_engine(3, args, zero={"zero_quantized_weights": quantized})
        with count_collectives() as counter:
            train(engine, 1, args.width, gen)
        out[f"gather:{quantized}"] = float(counter.bytes["all_gather"])
        engine.destroy()  # type: ignore[attr-defined]
    return out


def measure(args: argparse.Namespace) -> dict:
    gen = torch.Generator().manual_seed(dist.get_rank())
    return {"overlap": overlap_rows(args, gen), "bytes": wire_bytes(args, gen)}


def report(results: dict[str, dict[str, float]], args: argparse.Namespace) -> None:
    print(f"comm: {args.layers} x Linear({args.width}, {args.width}), micro batch {MICRO_BATCH}, 2 ranks, gloo")
    print(f"{'stage':>5} {'overlap_comm':<13} {'step ms':>9} {'on/off':>7}")
    for stage in args.stages:
        off = results["overlap"][f"{stage}:off"]
        for name in ("off", "on"):
            step = results["overlap"][f"{stage}:{name}"]
            print(f"{stage:>5} {name:<13} {step * 1e3:>9.1f} {step / off:>6.2f}x")
    print(f"{'communication_data_type':<24} {'reduce-scatter MiB/step':>24} {'vs fp32':>8}")
    for dtype in DTYPES:
        sent = results["bytes"][dtype]
        print(f"{dtype:<24} {sent / 2**20:>24.2f} {sent / results['bytes']['fp32']:>7.2f}x")
    exact, quantized = results["bytes"]["gather:False"], results["bytes"]["gather:True"]
    print(f"{'stage 3 all-gathers':<24} {'MiB/step':>24} {'vs exact':>8}")
    print(f"{'exact':<24} {exact / 2**20:>24.2f} {1:>7.2f}x")
    print(f"{'zero_quantized_weights':<24} {quantized / 2**20:>24.2f} {quantized / exact:>7.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 small layers, 2 steps, 1 round: a smoke run")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stages", default="2,3")
    parser.add_argument("--zeropp-layers", type=int, default=48, help="layers of the ZeRO++ table's model (48: 50M)")
    parser.add_argument("--zeropp-only", action="store_true", help="only the 4-rank ZeRO++ bytes table")
    args = parser.parse_args()
    args.stages = [int(s) for s in args.stages.split(",")]
    if args.quick:
        args.layers, args.width, args.steps, args.rounds, args.zeropp_layers = 2, 128, 2, 1, 2
    sys.path.insert(0, str(ROOT))
    if not args.zeropp_only:
        report(run_two_ranks(measure, args), args)
    _zeropp_bytes.report(run_two_ranks(_zeropp_bytes.measure, args, world=4), args)


if __name__ == "__main__":
    main()

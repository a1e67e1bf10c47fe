"""Long context: the longest sequence a small Llama-style decoder trains at under a fixed memory budget per rank,
per option, at 1 and 2 ranks (Ulysses), against the planner's prediction; and the step time at one common
length. Rows: plain, FPDT (chunked attention with its saved chunks on the host,
`slipstream.sequence.fpdt_attention` with `HostChunks`; at 2 ranks each rank holds 1/2 of every chunk),
activation checkpointing (`slipstream.checkpointing.checkpoint` per layer), + activation offload
(`cpu_checkpointing`), + tiled MLP and loss (ALST's `TiledMLP`, `TiledFusedLogitsLoss`), + both.

    python bench/long_context.py [--quick] [--budget-mib 48] [--steps 2] [--ranks 1,2]

The budget is enforced by counting: a length fits when the parameters plus the peak bytes of the tensors one
training step creates (activations, the backward's transient tensors and the gradients; counted tensor by
tensor with slipstream.profiling.live_tensors, tests/unit/planner/test_sequence.py) stay within it, on every
rank. Activation offload's and FPDT's host buffers are not counted: they hold what a GPU would move off the device (on
this CPU machine they share the one memory, so the offload row's time is the copies without a copy stream).
The search measures two lengths, extrapolates the crossing (the counted bytes grow linearly with fused
attention), and checks that the answer fits and 2% more does not; otherwise it bisects.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
from _long_context_model import Dims, Kit, Model, batch, param_bytes, step_peak
from _two_ranks import run_two_ranks

from slipstream.activation import recompute
from slipstream.planner.sequence import OPTIONS, SeqDims, sequence_rows
from slipstream.profiling.live_tensors import LiveTensorBytes
from slipstream.sequence.fpdt import fpdt_token_order
from slipstream.sequence.fpdt_attention import fpdt_attention
from slipstream.sequence.fpdt_store import HostChunks
from slipstream.sequence.layer import DistributedAttention
from slipstream.sequence.tiled import TiledFusedLogitsLoss, TiledMLP

FULL = Dims(hidden=128, layers=4, heads=4, intermediate=344, vocab=2048)
QUICK = Dims(hidden=64, layers=4, heads=4, intermediate=172, vocab=1024)
MARGIN = 1.02  # a measured answer: it fits, and this much longer does not
FPDT_CHUNK = 64  # tokens per FPDT chunk, over the group
STORES: dict[int, HostChunks] = {}  # the FPDT row's chunk store per world size


@dataclasses.dataclass(frozen=True)
class Args:
    dims: Dims
    budget: int
    common: int
    steps: int


def kit(option: str, world: int) -> Kit:
    tiled = "tiled" in option
    attention = None
    if option == "fpdt":
        return Kit(attention=_fpdt_attention(world))
    if world > 1:
        ulysses = DistributedAttention(None, dist.group.WORLD, scatter_idx=1, gather_idx=2)
        attention = lambda q, k, v: ulysses(q, k, v, is_causal=True)  # noqa: E731
    return Kit(
        checkpoint=None if option == "plain" else recompute.checkpoint,
        tiled_mlp=TiledMLP if tiled else None,
        tiled_loss=TiledFusedLogitsLoss if tiled else None,
        attention=attention,
    )


def _fpdt_attention(world: int) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """FPDT's chunked attention over the group, its saved chunks on the host (one store, buffers reused)."""
    store = STORES[world] = HostChunks()
    group = dist.group.WORLD if world > 1 else None

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        return fpdt_attention(q, k, v, chunk_size=FPDT_CHUNK, group=group, store=store).transpose(1, 2)

    return attention


def _batch(option: str, dims: Dims, seq: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's tokens and targets (FPDT: each rank holds 1/world of every chunk)."""
    rank = dist.get_rank() if world > 1 else 0
    order = fpdt_token_order(seq, FPDT_CHUNK, world) if option == "fpdt" and world > 1 else None
    return batch(dims, seq, rank, world, order)


def _build(option: str, dims: Dims, world: int) -> Model:
    recompute.configure(None, checkpoint_in_cpu="offload" in option)
    torch.manual_seed(0)
    return Model(dims, kit(option, world))


def _used(model: Model, option: str, dims: Dims, seq: int, world: int) -> int:
    """Parameters plus the peak of one step at `seq` tokens (split over the ranks), the most on any rank."""
    tokens, targets = _batch(option, dims, seq, world)
    model(tokens, targets).backward()  # a first step at this length: offload's host buffers exist after it
    used = torch.tensor(param_bytes(model) + step_peak(model, tokens, targets, LiveTensorBytes()))
    if world > 1:
        dist.all_reduce(used, op=dist.ReduceOp.MAX)
    return int(used)


def longest(model: Model, option: str, args: Args, world: int) -> tuple[int, int]:
    """(the longest multiple of `world` tokens that fits the budget, lengths tried)."""
    cache: dict[int, bool] = {}

    def fits(seq: int) -> bool:
        seq = max(world, seq // world * world)
        if seq not in cache:
            cache[seq] = _used(model, option, args.dims, seq, world) <= args.budget
        return cache[seq]

    low, high = 256 * world, 512 * world
    used_low, used_high = (_used(model, option, args.dims, n, world) for n in (low, high))
    slope = (used_high - used_low) / (high - low)
    guess = int(low + (args.budget - used_low) / slope) // world * world
    good, bad = (guess, int(guess * MARGIN)) if fits(guess) else (world, guess)
    if good == guess and fits(bad):
        good, bad = bad, bad * 4
        while fits(bad):
            good, bad = bad, bad * 2
    while bad - good > max(world, good * (MARGIN - 1)):
        middle = (good + bad) // 2 // world * world
        good, bad = (middle, bad) if fits(middle) else (good, middle)
    return good, len(cache) + 2


def _timed_step(model: Model, option: str, args: Args, world: int) -> float:
    recompute.configure(None, checkpoint_in_cpu="offload" in option)
    tokens, targets = _batch(option, args.dims, args.common, world)
    started = time.perf_counter()
    model(tokens, targets).backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def rows(args: Args) -> dict:
    """Every option at this world size: longest sequence, lengths tried, and the median step seconds at the
    common length (the options' steps interleaved round by round, after a warm-up round)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    torch.set_num_threads(max(1, 2 // world))
    results, models = {}, {}
    for option in OPTIONS:
        models[option] = _build(option, args.dims, world)
        found, tried = longest(models[option], option, args, world)
        results[option] = {"longest": found, "tried": tried}
    times: dict[str, list[float]] = {option: [] for option in OPTIONS}
    for _ in range(args.steps + 1):
        for option, model in models.items():
            times[option].append(_timed_step(model, option, args, world))
    for option in OPTIONS:
        results[option]["step_s"] = statistics.median(times[option][1:])
    results["fpdt"]["saved_peak"] = STORES[world].stats.device_bytes.peak
    recompute.reset()
    return results


def predicted(args: Args, world: int) -> dict[str, int]:
    """The planner's longest sequence per option, the parameters and the LM head's gradient (there from the
    backward's start) as the fixed bytes."""
    d = args.dims
    dims = SeqDims(
        hidden=d.hidden, layers=d.layers, heads=d.heads, vocab=d.vocab, intermediate=d.intermediate, kv_hidden=d.hidden
    )
    model = Model(d, Kit())
    fixed = param_bytes(model) + model.head.weight.numel() * 4
    answer = sequence_rows(dims, seq=None, dtype_bytes=4, ulysses=world, budget=args.budget, fixed_bytes=fixed)
    return {row.option: int(row.longest or 0) for row in answer}


def report(results: dict[int, dict], args: Args) -> None:
    d = args.dims
    print(
        f"Llama-style decoder: {d.layers} layers, width {d.hidden}, {d.heads} heads, MLP {d.intermediate}, "
        f"vocab {d.vocab}, fp32; budget {args.budget / 2**20:.0f} MiB per rank (parameters + counted step peak)"
    )
    base = results[1]["plain"]
    print(
        f"{'ranks':>5} {'option':28} {'longest':>8} {'x plain@1':>9} {'planned':>8} {'plan/meas':>9} "
        f"{'step s @' + str(args.common):>12} {'x ckpt':>7}"
    )
    for world, table in results.items():
        plan = predicted(args, world)
        for option, row in table.items():
            ratio = row["longest"] / base["longest"]
            versus = plan[option] / row["longest"] if row["longest"] else float("nan")
            ckpt = row["step_s"] / table["checkpointing"]["step_s"]
            print(
                f"{world:>5} {option:28} {row['longest']:>8} {ratio:>9.2f} {plan[option]:>8} {versus:>9.3f} "
                f"{row['step_s']:>12.3f} {ckpt:>7.2f}"
            )
    one = results[1]
    print(
        f"targets: best one-rank longest / plain {max(r['longest'] for r in one.values()) / base['longest']:.2f}x "
        f"(>= 4x); offload step / checkpointing alone "
        f"{one['checkpointing+offload']['step_s'] / one['checkpointing']['step_s']:.2f}x (<= 1.15x); "
        "planned / measured within 10%"
    )
    for world, table in results.items():
        print(
            f"fpdt at {world} rank(s): the chunk store's device-resident saved chunks peaked at "
            f"{table['fpdt']['saved_peak'] / 2**10:.1f} KiB (chunks of {FPDT_CHUNK} tokens, the rest on the host)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model and budget (a smoke run)")
    parser.add_argument("--budget-mib", type=float, default=None, help="memory per rank (default 48, quick 12)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per option (after one warm-up)")
    parser.add_argument("--ranks", default="1,2", help="world sizes to run, e.g. 1 or 1,2")
    parser.add_argument("--common", type=int, default=None, help="the length every option is timed at")
    options = parser.parse_args()
    dims = QUICK if options.quick else FULL
    budget = int((options.budget_mib or (12 if options.quick else 48)) * 2**20)
    args = Args(
        dims=dims, budget=budget, common=options.common or (512 if options.quick else 1024), steps=options.steps
    )
    results: dict[int, dict] = {}
    for world in (int(w) for w in options.ranks.split(",")):
        results[world] = rows(args) if world == 1 else run_two_ranks(rows, args)
    report(results, args)


if __name__ == "__main__":
    main()

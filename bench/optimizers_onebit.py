"""Bytes on the wire per optimizer step: Adam's fp32 gradient all-reduce against 1-bit Adam, 0/1 Adam and 1-bit LAMB.

    python bench/optimizers_onebit.py [--quick] [--layers 48] [--width 1024] [--steps 4]

Two ranks (gloo, one thread each; bench/_two_ranks.py) train a stack of `--layers` Linear(width, width) + ReLU
blocks (48 x 1024: 50.4M parameters, fp32, ZeRO stage 0, the default bucket size: one bucket) with each optimizer through the engine.
Each rank counts the bytes it hands to the collectives in every step (slipstream.comm's counter: the
all-reduce's buffer, the all-to-all's input, the all-gather's output), split into warm-up steps (full
precision) and compressed steps. The ratio is Adam's bytes per step over the optimizer's; the target is >= 16x
per compressed step. 0/1 Adam syncs every `local_step_interval` steps once its variance is frozen; its
row runs with the interval at 1 (every step synchronises), the most it ever sends. DeepSpeed's 1-bit optimizers
need NCCL and cupy, so there is no peer row on CPU. The step time is printed for information only. The row
OneBitAdam@ZeRO-1 runs 1-bit Adam at ZeRO stage 1 (the gradients compressed, [Note: 1-bit gradients at stage 1]):
its compressed step still all-gathers the updated fp32 parameters, as every ZeRO-1 step does.

    python bench/optimizers_onebit.py --loss [--loss-steps 300]

The loss comparison instead trains examples/gpt's GPT (shrunk to 2 layers of width 64 on 32-character samples, so
that 300 steps take about a minute per optimizer on two CPU ranks) on the shipped corpus, 8 samples per rank per
step, the same seeded batches for every optimizer: Adam (torch's, bias-corrected), 1-bit Adam and 0/1 Adam at
ZeRO 0, and 1-bit Adam at ZeRO 1, their warm-ups a third of the run. It prints each one's final loss (the mean of
the last 20 steps' losses, rank 0's micro-batches) and its ratio to Adam's; the target is within 2%.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from _two_ranks import make_mlp, run_two_ranks

ROWS = {
    "Adam": {"type": "Adam", "params": {"lr": 1e-4}},
    "OneBitAdam": {"type": "OneBitAdam", "params": {"lr": 1e-4, "freeze_step": 1, "comm_backend_name": "gloo"}},
    "OneBitAdam@ZeRO-1": {
        "type": "OneBitAdam",
        "params": {"lr": 1e-4, "freeze_step": 1, "comm_backend_name": "gloo"},
        "zero_stage": 1,
    },
    "ZeroOneAdam": {
        "type": "ZeroOneAdam",
        "params": {"lr": 1e-4, "var_freeze_step": 0, "var_update_scaler": 1, "comm_backend_name": "gloo"},
    },
    "OneBitLamb": {"type": "OneBitLamb", "params": {"lr": 1e-4, "freeze_step": 1, "comm_backend_name": "gloo"}},
}


WIRE_SHARE = {"all_reduce": 2.0, "all_to_all": 1.0, "all_gather": 1.0}
"""What a rank sends of a counted buffer, times (world - 1) / world: a ring all-reduce sends its buffer twice over
(reduce-scatter, then all-gather), an all-to-all and an all-gather once (less the rank's own chunk)."""


def measure(optimizer: dict, *, layers: int, width: int, steps: int) -> list[tuple[int, float, float]]:
    """(bytes this rank handed to collectives, bytes it sent on the wire, seconds) for each of `steps` steps."""
    import slipstream
    from slipstream.comm import count_collectives

    optimizer = dict(optimizer)
    zero = {"stage": optimizer.pop("zero_stage", 0)}
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": optimizer, "steps_per_print": 10**6}
    config["zero_optimization"] = zero
    engine, _, _, _ = slipstream.initialize(model=make_mlp(layers, width), config=config)
    x = torch.randn(4, width, generator=torch.Generator().manual_seed(dist.get_rank()))
    out = []
    for _ in range(steps):
        started = time.perf_counter()
        with count_collectives() as counted:
            engine.backward(engine(x).pow(2).mean())
            engine.step()
        world = dist.get_world_size()
        wire = sum(WIRE_SHARE.get(op, 1.0) * size * (world - 1) / world for op, size in counted.bytes.items())
        out.append((sum(counted.bytes.values()), wire, time.perf_counter() - started))
    engine.destroy()
    return out


def rank_main(args: object) -> dict:
    assert isinstance(args, argparse.Namespace)
    return {name: measure(cfg, layers=args.layers, width=args.width, steps=args.steps) for name, cfg in ROWS.items()}


def report(results: dict[str, list[tuple[int, float, float]]], *, layers: int, width: int) -> None:
    params = layers * (width * width + width)
    adam = results["Adam"][-1]
    print(
        f"{params / 1e6:.1f}M parameters, fp32, 2 ranks (gloo), rank 0's bytes per step: counted (the buffers "
        "handed to collectives) and sent (on the wire: ring all-reduce)"
    )
    print(
        f"{'optimizer':<17} {'step':>4} {'kind':<11} {'counted':>13} {'Adam/this':>10} {'sent':>13} "
        f"{'Adam/this':>10} {'seconds':>8}"
    )
    warmups = {"Adam": 10**9, "OneBitAdam": 1, "OneBitAdam@ZeRO-1": 1, "ZeroOneAdam": 1, "OneBitLamb": 1}
    for name, steps in results.items():
        for number, (counted, sent, seconds) in enumerate(steps, start=1):
            kind = "full" if number <= warmups[name] else "compressed"
            print(
                f"{name:<17} {number:>4} {kind:<11} {counted:>13,} {adam[0] / counted:>9.2f}x {sent:>13,.0f} "
                f"{adam[1] / sent:>9.2f}x {seconds:>8.2f}"
            )


def loss_rows(steps: int) -> dict[str, dict]:
    """The loss comparison's optimizers: lr 3e-3 and betas (0.9, 0.95) as examples/gpt's config, warm-ups steps/3."""
    common = {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.01}
    onebit = {**common, "freeze_step": steps // 3, "comm_backend_name": "gloo"}
    return {
        "Adam": {"type": "Adam", "params": common},
        "OneBitAdam": {"type": "OneBitAdam", "params": onebit},
        "OneBitAdam@ZeRO-1": {"type": "OneBitAdam", "params": onebit, "zero_stage": 1},
        "ZeroOneAdam": {
            "type": "ZeroOneAdam",
            "params": {**common, "var_freeze_step": steps // 3, "comm_backend_name": "gloo"},
        },
    }


def train_gpt(optimizer: dict, *, steps: int) -> list[float]:
    """Rank 0's loss at each of `steps` steps of the shrunk examples/gpt model (see the module docstring)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "gpt"))
    from data import CharDataset
    from model import GPT, GPTConfig

    import slipstream

    optimizer = dict(optimizer)
    zero = {"stage": optimizer.pop("zero_stage", 0)}
    config = {"train_micro_batch_size_per_gpu": 8, "optimizer": optimizer, "gradient_clipping": 1.0,
              "zero_optimization": zero, "steps_per_print": 10**6}  # fmt: skip
    data = CharDataset(block_size=32)
    torch.manual_seed(1234)
    model = GPT(GPTConfig(vocab_size=data.vocab_size, block_size=32, n_layer=2, n_head=4, n_embd=64))
    engine, _, _, _ = slipstream.initialize(model=model, config=config)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))
    rank, world, losses = dist.get_rank(), dist.get_world_size(), []
    for step in range(steps):
        start = (step * world + rank) * 8
        picked = [data[int(i)] for i in order[start % len(data) : start % len(data) + 8]]
        inputs, targets = torch.stack([x for x, _ in picked]), torch.stack([y for _, y in picked])
        engine.backward(engine(inputs, targets))
        engine.step()
        losses.append(float(engine.last_loss))
    engine.destroy()
    return losses


def loss_main(args: object) -> dict:
    assert isinstance(args, argparse.Namespace)
    out = {}
    for name, optimizer in loss_rows(args.loss_steps).items():
        started = time.perf_counter()
        losses = train_gpt(optimizer, steps=args.loss_steps)
        out[name] = {"losses": losses, "seconds": time.perf_counter() - started}
    return out


def report_losses(results: dict[str, dict], *, steps: int) -> None:
    final = {name: sum(r["losses"][-20:]) / 20 for name, r in results.items()}
    print(f"examples/gpt (2 layers x 64, 32-character samples), {steps} steps, 2 ranks (gloo), 8 samples per rank")
    print(f"{'optimizer':<17} {'first':>7} {'final':>7} {'final/Adam':>10} {'seconds':>8}")
    for name, r in results.items():
        print(f"{name:<17} {r['losses'][0]:>7.4f} {final[name]:>7.4f} {final[name] / final['Adam']:>9.4f}x "
              f"{r['seconds']:>8.1f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 layers of 256, 3 steps")
    parser.add_argument("--loss", action="store_true", help="the examples/gpt loss comparison instead of the bytes")
    parser.add_argument("--loss-steps", type=int, default=300)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    if args.loss:
        report_losses(run_two_ranks(loss_main, args), steps=args.loss_steps)
        return
    if args.quick:
        args.layers, args.width, args.steps = 4, 256, 3
    report(run_two_ranks(rank_main, args), layers=args.layers, width=args.width)


if __name__ == "__main__":
    main()

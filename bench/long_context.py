"""Long context: step time and peak saved-activation bytes of a small Llama-style model at a long sequence,
plain against `slipstream.checkpointing.checkpoint` per layer, with and without activation offload
(`cpu_checkpointing`). One process; rows interleaved round by round.

    python bench/long_context.py [--quick] [--seq 4096] [--rounds 2] [--steps 2]

Saved-activation bytes are what autograd holds for the backward on the device, counted storage by storage
until freed (slipstream.activation.live_bytes): every tensor saved outside the checkpointed calls, the
checkpointed inputs, and for the offload row the inputs' originals until released and their restored copies.
The recomputation's own short-lived activations are not counted (the same in both checkpointed rows). On a
CPU-only machine the offloaded copies live in the same memory, so the offload row's bytes say what a GPU
would free, while its time is the copy cost without the overlap a copy stream gives.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("OMP_NUM_THREADS", "2")

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.activation import recompute
from slipstream.activation.live_bytes import LiveBytes, counting_saved

WIDTH, HEADS, LAYERS, VOCAB = 128, 4, 6, 512
ROWS = ("plain", "checkpointing", "checkpointing+offload")


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n1, self.n2 = nn.RMSNorm(WIDTH), nn.RMSNorm(WIDTH)
        self.qkv, self.out = nn.Linear(WIDTH, 3 * WIDTH, bias=False), nn.Linear(WIDTH, WIDTH, bias=False)
        self.gate_up, self.down = nn.Linear(WIDTH, 6 * WIDTH, bias=False), nn.Linear(3 * WIDTH, WIDTH, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, s, w = h.shape
        q, k, v = self.qkv(self.n1(h)).view(b, s, 3, HEADS, w // HEADS).permute(2, 0, 3, 1, 4)
        h = h + self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, w))
        gate, up = self.gate_up(self.n2(h)).chunk(2, dim=-1)
        return h + self.down(F.silu(gate) * up)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))

    def forward(self, tokens: torch.Tensor, run: Callable[..., torch.Tensor] | None) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h) if run is None else run(layer, h)
        logits = self.head(h[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def measure(row: str, seq: int, steps: int) -> tuple[float, int]:
    """Median step seconds and the peak saved-activation bytes of `row`."""
    recompute.configure(None, checkpoint_in_cpu=row.endswith("offload"))
    meter = LiveBytes()
    recompute.store().stats.device_bytes = meter  # the checkpointed inputs count in the same meter
    torch.manual_seed(0)
    model = Model()
    tokens = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(1))

    def checkpointed(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
        with counting_saved(meter):  # sees the checkpointed inputs unless the store takes them
            return recompute.checkpoint(layer, h)

    run = None if row == "plain" else checkpointed
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        with counting_saved(meter):
            loss = model(tokens, run)
        loss.backward()
        times.append(time.perf_counter() - started)
        model.zero_grad(set_to_none=True)
    return statistics.median(times), meter.peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a smoke run: seq 1024, one round of one step")
    args = parser.parse_args()
    if args.quick:
        args.seq, args.rounds, args.steps = 1024, 1, 1
    results: dict[str, list[tuple[float, int]]] = {row: [] for row in ROWS}
    for _ in range(args.rounds):
        for row in ROWS:
            results[row].append(measure(row, args.seq, args.steps))
    print(f"seq {args.seq}, {LAYERS} layers, width {WIDTH}, batch 1, fp32, {torch.get_num_threads()} threads")
    base_time = statistics.median(t for t, _ in results["plain"])
    base_bytes = max(b for _, b in results["plain"])
    print(f"{'row':24} {'step s':>8} {'x plain':>8} {'saved MiB':>10} {'x plain':>8}")
    for row in ROWS:
        step = statistics.median(t for t, _ in results[row])
        peak = max(b for _, b in results[row])
        print(f"{row:24} {step:8.3f} {step / base_time:8.2f} {peak / 2**20:10.1f} {peak / base_bytes:8.3f}")


if __name__ == "__main__":
    main()

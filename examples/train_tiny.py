"""Train a tiny character-level transformer end to end on this machine with Slipstream's CPU Adam.

    python examples/train_tiny.py [--steps 150] [--seed 0]

It learns to continue a repeating text, prints the loss every 25 steps and the throughput, and exits
non-zero if the loss did not fall below a tenth of its first value (so it doubles as a smoke test).
The native `cpu_adam` op is compiled on first use (about 30 s, cached afterwards); without a compiler it
runs the PyTorch fallback and says so.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch import nn

from slipstream.ops.adam import DeepSpeedCPUAdam
from slipstream.ops.op_builder import CPUAdamBuilder

TEXT = "slipstream shards optimizer state, gradients and parameters across ranks. " * 8


class TinyCharModel(nn.Module):
    def __init__(self, vocab: int, *, dim: int = 64, heads: int = 4, layers: int = 2, seq: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=4 * dim, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        return self.head(self.blocks(x, mask=self.mask[: tokens.shape[1], : tokens.shape[1]], is_causal=True))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    vocab = sorted(set(TEXT))
    data = torch.tensor([vocab.index(c) for c in TEXT])
    seq = 32
    model = TinyCharModel(len(vocab), seq=seq)
    optimizer = DeepSpeedCPUAdam(model.parameters(), lr=3e-3, weight_decay=0.01)
    loaded = CPUAdamBuilder().load_status()
    print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters; "
          f"cpu_adam: {loaded.how if loaded else 'unknown'}")

    losses = []
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, len(data) - seq - 1, (args.batch,))
        inputs = torch.stack([data[s : s + seq] for s in starts])
        targets = torch.stack([data[s + 1 : s + seq + 1] for s in starts])
        loss = nn.functional.cross_entropy(model(inputs).reshape(-1, len(vocab)), targets.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if step == 1 or step % 25 == 0:
            print(f"step {step:4d}  loss {loss.item():.4f}")
    elapsed = time.perf_counter() - started
    print(f"{args.steps} steps in {elapsed:.1f} s ({args.steps * args.batch * seq / elapsed:,.0f} tokens/s)")
    if losses[-1] > losses[0] / 10:
        print(f"FAILED: loss went from {losses[0]:.3f} to {losses[-1]:.3f}, expected a 10x drop", file=sys.stderr)
        return 1
    print(f"OK: loss fell from {losses[0]:.3f} to {losses[-1]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Tiny pipeline models for the pipeline tests, and their single-process reference.

A token model: a tied embedding (TiedLayerSpec "embed"), residual tanh blocks, and the embedding again as
the output head (forward_fn: logits = h @ E^T); loss is cross-entropy. A "dict" variant passes a dict of
tensors ({"h", "scale"}) between its blocks. Layers are seeded per index (seed_layers), so the pipeline and
the reference build identical weights. `reference` trains the same layers on the same micro-batches in one
process with torch.optim.AdamW, clipping by the global norm, and returns its parameters under the pipeline's
names ("<layer index>.<param>", "tied_modules.embed.weight") and its per-step norms and losses.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

VOCAB, DIM = 23, 12
LR, CLIP = 1e-2, 0.5


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(VOCAB, DIM) * 0.3)

    def forward(self, tokens: Tensor) -> Tensor:
        return F.embedding(tokens, self.weight)


def head(embed: Embed, h: Tensor) -> Tensor:
    return h @ embed.weight.t()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, h: Tensor) -> Tensor:
        return h + torch.tanh(self.lin(h))


class DictIn(nn.Module):
    """h -> {"h": h, "scale": a learned per-feature scale broadcast to h}."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(DIM) + 0.1 * torch.randn(DIM))

    def forward(self, h: Tensor) -> dict:
        return {"h": h, "scale": self.scale.expand_as(h), "note": "dict"}


class DictBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: dict) -> dict:
        return {"h": x["h"] + torch.tanh(self.lin(x["h"] * x["scale"])), "scale": x["scale"], "note": x["note"]}


class DictOut(nn.Module):
    def forward(self, x: dict) -> Tensor:
        return x["h"]


def loss_fn(logits: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def specs(kind: str = "plain", blocks: int = 6) -> list:
    from slipstream.pipe import LayerSpec, TiedLayerSpec

    body = [LayerSpec(Block) for _ in range(blocks)]
    if kind == "dict":
        body = [LayerSpec(DictIn)] + [LayerSpec(DictBlock) for _ in range(blocks)] + [LayerSpec(DictOut)]
    return [TiedLayerSpec("embed", Embed), *body, TiedLayerSpec("embed", Embed, forward_fn=head)]


def micro_batch(step: int, dp_rank: int, micro: int, *, size: int = 3, seq: int | None = None) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + 100 * dp_rank + micro)
    length = seq if seq is not None else 5
    tokens = torch.randint(0, VOCAB, (size, length), generator=gen)
    return tokens, torch.roll(tokens, 1, dims=1)


def build_reference(layer_specs: list, base_seed: int = 1234) -> tuple[nn.Module, list]:
    from slipstream.pipe import TiedLayerSpec

    root = nn.Module()
    root.tied_modules = nn.ModuleDict()
    funcs = []
    for i, spec in enumerate(layer_specs):
        torch.manual_seed(base_seed + i)
        if isinstance(spec, TiedLayerSpec):
            if spec.key not in root.tied_modules:
                root.tied_modules[spec.key] = spec.build()
            module = root.tied_modules[spec.key]
            funcs.append(module if spec.forward_fn is None else (lambda x, f=spec.forward_fn, m=module: f(m, x)))
        else:
            module = spec.build()
            root.add_module(str(i), module)
            funcs.append(module)
    return root, funcs


def reference(kind: str, *, steps: int, dp: int, micros: int, seqs: list[int] | None = None) -> dict:
    batches = [
        [micro_batch(step, r, m, seq=None if seqs is None else seqs[m]) for r in range(dp) for m in range(micros)]
        for step in range(steps)
    ]
    return reference_on(kind, batches)


def dataset(rows: int = 24) -> list[tuple[Tensor, Tensor]]:
    """(tokens, labels) rows for initialize(training_data=...)."""
    tokens, labels = micro_batch(7, 0, 0, size=rows)
    return list(zip(tokens, labels))


def loader_batches(rows: int, micro: int, micros: int, steps: int) -> list[list[tuple[Tensor, Tensor]]]:
    """The micro-batches the engine's training loader gives one data-parallel rank (shuffled with seed 0, the
    same order every epoch), restarted at its end, grouped by train_batch."""
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    data = dataset(rows)
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)  # type: ignore[var-annotated]
    order = list(DataLoader(data, batch_size=micro, sampler=sampler))  # type: ignore[arg-type]
    flat = [order[i % len(order)] for i in range(micros * steps)]
    return [[(b[0], b[1]) for b in flat[s * micros : (s + 1) * micros]] for s in range(steps)]


def reference_on(kind: str, batches: list[list[tuple[Tensor, Tensor]]]) -> dict:
    root, funcs = build_reference(specs(kind))
    optimizer = torch.optim.AdamW(root.parameters(), lr=LR, weight_decay=0.0)
    losses, norms = [], []
    for batch in batches:
        total = 0.0
        for x, y in batch:
            for f in funcs:
                x = f(x)
            loss = loss_fn(x, y)
            (loss / len(batch)).backward()
            total += float(loss.detach())
        norms.append(float(torch.nn.utils.clip_grad_norm_(root.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total / len(batch))
    return {"params": {n: p.detach().clone() for n, p in root.named_parameters()}, "losses": losses, "norms": norms}

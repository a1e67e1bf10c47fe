"""The top eigenvalue of each block's Hessian, by power iteration (what DeepSpeed's `eigenvalue` section
computes).

For block b with parameters p_b and gradient g_b = dL/dp_b (taken with create_graph), the Hessian-vector product
H_bb v = d(g_b . v)/dp_b is one more backward through the gradient's graph. Power iteration from a random unit
vector v (the norm plus `stability` divides it; non-finite entries become 0): lambda = <H v, v>, v = H v / |H v|,
until the relative change of lambda is below `tol`, `max_iter` products were taken, or lambda is 0. Parameters
whose gradient does not depend on the parameters (no second-order term) are left out, as DeepSpeed does. The
values reported to the monitors are DeepSpeed's: each block's |lambda| over the largest |lambda| of the blocks
(a block whose lambda is 0 reports 1.0).

The random start comes from a generator of its own (seeded per block), so training draws the same random
numbers with or without the probe.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["BlockEigenvalue", "block_eigenvalues", "find_blocks", "hessian_eigenvalue", "relative_to_largest"]


@dataclasses.dataclass(frozen=True, slots=True)
class BlockEigenvalue:
    value: float
    """The power iteration's eigenvalue (largest in magnitude) of the block's Hessian."""
    iterations: int


def find_blocks(module: nn.Module, layer_name: str, layer_num: int) -> list[nn.Module]:
    """The first `layer_num` blocks of the list at dotted attribute `layer_name` of `module`."""
    found: object = module
    for part in layer_name.split("."):
        if not hasattr(found, part):
            raise ValueError(
                f"eigenvalue.layer_name {layer_name!r}: {type(found).__name__} has no attribute {part!r}; name the "
                "model's list of blocks by its attribute path (e.g. 'encoder.layers')"
            )
        found = getattr(found, part)
    if not isinstance(found, (nn.ModuleList, nn.Sequential)) or len(found) < layer_num:
        size = len(found) if isinstance(found, (nn.ModuleList, nn.Sequential)) else "not a module list"
        raise ValueError(
            f"eigenvalue.layer_num {layer_num}: {layer_name!r} holds {size} blocks; set layer_num to at most the "
            "number of blocks of an nn.ModuleList or nn.Sequential"
        )
    return [found[i] for i in range(layer_num)]


def block_eigenvalues(
    loss: torch.Tensor, blocks: Sequence[nn.Module], *, max_iter: int, tol: float, stability: float
) -> list[BlockEigenvalue]:
    """The eigenvalue of each block's Hessian of `loss`; the graph of `loss` is kept for its own backward."""
    params = [[p for p in block.parameters() if p.requires_grad] for block in blocks]
    flat = [p for group in params for p in group]
    grads = torch.autograd.grad(loss, flat, create_graph=True, retain_graph=True, allow_unused=True)
    found, start = [], 0
    for index, group in enumerate(params):
        pairs = [(p, g) for p, g in zip(group, grads[start : start + len(group)]) if g is not None and g.requires_grad]
        start += len(group)
        found.append(
            hessian_eigenvalue(
                [g for _, g in pairs],
                [p for p, _ in pairs],
                max_iter=max_iter,
                tol=tol,
                stability=stability,
                seed=index,
            )
        )
    return found


def hessian_eigenvalue(
    grads: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    *,
    max_iter: int,
    tol: float,
    stability: float,
    seed: int = 0,
) -> BlockEigenvalue:
    """Power iteration on the Hessian of `params` whose gradients `grads` carry their graph (module doc)."""
    if not params:
        return BlockEigenvalue(0.0, 0)
    generator = torch.Generator(device=params[0].device).manual_seed(seed)
    vector = _unit(
        [torch.randn(p.shape, generator=generator, device=p.device, dtype=torch.float32) for p in params], stability
    )
    current, previous, iterations = 1.0, 0.0, 0
    while iterations < max_iter and current != 0.0 and abs((current - previous) / current) >= tol:
        previous = current
        weights = [v.to(g.dtype) for v, g in zip(vector, grads)]
        product = [
            torch.zeros_like(v) if h is None else torch.nan_to_num(h.float(), nan=0.0, posinf=0.0, neginf=0.0)
            for v, h in zip(vector, torch.autograd.grad(grads, params, weights, retain_graph=True, allow_unused=True))
        ]
        current = float(_dot(product, vector))
        vector = _unit(product, stability)
        iterations += 1
    return BlockEigenvalue(current, iterations)


def relative_to_largest(values: Sequence[float]) -> list[float]:
    """DeepSpeed's post-processing: |value| / max |value| (1.0 for a zero value, and when all are zero)."""
    largest = max((abs(v) for v in values), default=0.0)
    return [abs(v) / largest if v != 0.0 and largest > 0 else 1.0 for v in values]


def _dot(xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor]) -> torch.Tensor:
    return sum((torch.sum(x * y) for x, y in zip(xs, ys)), torch.zeros((), device=xs[0].device))


def _unit(vector: Sequence[torch.Tensor], stability: float) -> list[torch.Tensor]:
    norm = float(_dot(vector, vector)) ** 0.5 + stability
    return [torch.nan_to_num(v / norm, nan=0.0, posinf=0.0, neginf=0.0) for v in vector]

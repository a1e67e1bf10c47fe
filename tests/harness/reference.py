"""Single-process training reference that every distributed feature is checked against.

Owns `train_reference`: build the model with `model_fn`, train it with a stock torch.optim
optimizer on the given batches, and return the per-step losses plus the final parameters.
Distributed parity tests compare their losses to these and their (sharded) parameters to
slices of the returned state dict.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

Batch = tuple[Tensor, Tensor]
LossFn = Callable[[Tensor, Tensor], Tensor]
_OPTIMIZERS = ("adamw", "adam", "sgd")


def make_optimizer(params: list[nn.Parameter], *, optimizer: str, lr: float, weight_decay: float,
                   betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> torch.optim.Optimizer:
    """The stock optimizer matching `optimizer` ("adamw": decoupled decay, "adam": L2 decay, "sgd")."""
    if optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if optimizer == "adam":
        return torch.optim.Adam(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"train_reference: optimizer={optimizer!r} is not supported; use one of {_OPTIMIZERS}")


def train_reference(model_fn: Callable[[], nn.Module], batches: Sequence[Batch], *, lr: float, steps: int,
                    optimizer: str = "adamw", weight_decay: float = 0.0, grad_clip: float | None = None,
                    loss_fn: LossFn | None = None) -> tuple[list[float], dict[str, Tensor]]:
    """Train `model_fn()` for `steps` steps on `batches` (step i uses batches[i % len(batches)]).

    The loss is `loss_fn(model(inputs), targets)`, by default the model's own `loss` (TinyMLP,
    TinyTransformer). `grad_clip` clips the global grad norm before each step. Returns the loss of
    each step (computed before that step's update) and a detached copy of the final state dict.
    """
    if steps < 0 or (steps > 0 and not batches):
        raise ValueError(f"train_reference: steps={steps} with {len(batches)} batches; need steps >= 0 and "
                         "at least one batch")
    model = model_fn()
    compute_loss = loss_fn if loss_fn is not None else getattr(model, "loss", None)
    if compute_loss is None:
        raise TypeError(f"train_reference: {type(model).__name__} has no `loss(outputs, targets)`; pass loss_fn=")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(params, optimizer=optimizer, lr=lr, weight_decay=weight_decay)
    losses: list[float] = []
    for step in range(steps):
        inputs, targets = batches[step % len(batches)]
        opt.zero_grad(set_to_none=True)
        loss = compute_loss(model(inputs), targets)
        loss.backward()
        if grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}

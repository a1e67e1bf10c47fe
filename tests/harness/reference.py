"""Single-process training reference that every distributed feature is checked against.

Owns `run_reference` and its wrappers: build the model with `model_fn`, train it with a stock torch.optim
optimizer, and return the per-step losses, the pre-clip global gradient norms (what `clip_grad_norm_`
returns: compare `engine.get_global_grad_norm()` with them), the final parameters, the fp32 master weights
and the optimizer state. Distributed parity tests compare their losses to these and their (sharded)
parameters to slices of the returned tensors.

The reference does the engine's arithmetic, not only its maths: the optimizer steps fp32 masters; in bf16
or fp16 the model runs in that dtype on inputs cast to it, each micro-batch's gradients are accumulated in
fp32, divided once by the number of micro-batches (times the loss scale), clipped by their global norm, and
the updated masters are cast back into the model. So a low-precision engine can be held to fp32 rounding
noise instead of bf16's 1%: a tolerance of that size would pass a run that skipped a step or dropped weight
decay.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor, nn

Batch = tuple[Tensor, Tensor]
LossFn = Callable[[Tensor, Tensor], Tensor]
MicroLosses = Callable[[nn.Module, int], Iterable[Tensor]]
_OPTIMIZERS = ("adamw", "adam", "sgd")


@dataclasses.dataclass(frozen=True)
class ReferenceRun:
    losses: list[float]
    """Each step's loss, the mean over its micro-batches, computed before that step's update."""
    grad_norms: list[float]
    """Each step's global L2 gradient norm before clipping (`clip_grad_norm_`'s return value)."""
    params: dict[str, Tensor]
    """The final state dict, in the model dtype."""
    masters: dict[str, Tensor]
    """The final fp32 master weights of the trainable parameters, by name."""
    optimizer_state: dict[str, dict[str, Tensor]]
    """The optimizer's tensors (exp_avg, exp_avg_sq, ...) per trainable parameter name."""


def make_optimizer(params: list[Tensor], *, optimizer: str, lr: float, weight_decay: float,
                   betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> torch.optim.Optimizer:
    """The stock optimizer matching `optimizer` ("adamw": decoupled decay, "adam": L2 decay, "sgd")."""
    if optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if optimizer == "adam":
        return torch.optim.Adam(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"train_reference: optimizer={optimizer!r} is not supported; use one of {_OPTIMIZERS}")


def run_reference(model_fn: Callable[[], nn.Module], micro_losses: MicroLosses, *, lr: float, steps: int,
                  optimizer: str = "adamw", weight_decay: float = 0.0, grad_clip: float | None = None,
                  dtype: torch.dtype = torch.float32, loss_scale: float = 1.0) -> ReferenceRun:
    """Train `model_fn()` (cast to `dtype`) for `steps` steps; step s backwards each loss of `micro_losses(model, s)`.

    The step's gradient is the mean of the micro-batches' gradients (every trainable parameter gets one, zero
    when no micro-batch used it, as in ZeRO's flat buffers). `grad_clip` clips the global norm before each step.
    """
    model = model_fn()
    if dtype != torch.float32:
        model.to(dtype)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    masters = {n: p.detach().float().clone() for n, p in named}
    opt = make_optimizer(list(masters.values()), optimizer=optimizer, lr=lr, weight_decay=weight_decay)
    losses: list[float] = []
    norms: list[float] = []
    for step in range(steps):
        sums = {n: torch.zeros_like(m) for n, m in masters.items()}
        count, total = 0, 0.0
        for loss in micro_losses(model, step):
            (loss * loss_scale if loss_scale != 1.0 else loss).backward()
            for name, param in named:
                if param.grad is not None:
                    sums[name] += param.grad.float()
                    param.grad = None
            count, total = count + 1, total + loss.item()
        for name, master in masters.items():
            master.grad = sums[name] / (count * loss_scale)
        limit = grad_clip if grad_clip is not None else math.inf
        norms.append(float(torch.nn.utils.clip_grad_norm_(list(masters.values()), limit)))
        opt.step()
        with torch.no_grad():
            for name, param in named:
                param.copy_(masters[name])
        losses.append(total / count)
    state = {n: {k: v.clone() for k, v in opt.state[m].items() if isinstance(v, Tensor) and v.dim() > 0}
             for n, m in masters.items()}
    return ReferenceRun(losses=losses, grad_norms=norms,
                        params={k: v.detach().clone() for k, v in model.state_dict().items()},
                        masters={n: m.detach().clone() for n, m in masters.items()}, optimizer_state=state)


def split_losses(batch: Batch, loss_fn: LossFn, *, world: int, micro: int, gas: int,
                 dtype: torch.dtype = torch.float32) -> Callable[[nn.Module], list[Tensor]]:
    """The losses of `batch` split as the engine tests split it: micro-batch m of rank r is rows
    [(m * world + r) * micro, ... + micro), inputs cast to `dtype` when floating, outputs cast back to fp32."""

    def losses(model: nn.Module) -> list[Tensor]:
        inputs, targets = batch
        out = []
        for m in range(gas):
            for r in range(world):
                start = (m * world + r) * micro
                x = inputs[start:start + micro]
                x = x.to(dtype) if x.is_floating_point() else x
                out.append(loss_fn(model(x).float(), targets[start:start + micro]))
        return out

    return losses


def reference_run(model_fn: Callable[[], nn.Module], batches: Sequence[Batch], *, lr: float, steps: int,
                  optimizer: str = "adamw", weight_decay: float = 0.0, grad_clip: float | None = None,
                  loss_fn: LossFn | None = None, split: tuple[int, int, int] | None = None,
                  dtype: torch.dtype = torch.float32, loss_scale: float = 1.0) -> ReferenceRun:
    """`run_reference` on `batches` (step i uses batches[i % len(batches)]).

    The loss is `loss_fn(model(inputs), targets)`, by default the model's own `loss` (TinyMLP,
    TinyTransformer). Without `split` each step is one full-batch loss; with `split=(world, micro, gas)`
    each step backwards the engine's micro-batches one by one (`split_losses`), as a low-precision reference
    must, since bf16 rounds each micro-batch's gradients separately.
    """
    if steps < 0 or (steps > 0 and not batches):
        raise ValueError(f"train_reference: steps={steps} with {len(batches)} batches; need steps >= 0 and "
                         "at least one batch")
    probe = model_fn()
    compute_loss = loss_fn if loss_fn is not None else getattr(probe, "loss", None)
    if compute_loss is None:
        raise TypeError(f"train_reference: {type(probe).__name__} has no `loss(outputs, targets)`; pass loss_fn=")

    def micro_losses(model: nn.Module, step: int) -> list[Tensor]:
        batch = batches[step % len(batches)]
        if split is None:
            return [compute_loss(model(batch[0]), batch[1])]
        world, micro, gas = split
        return split_losses(batch, compute_loss, world=world, micro=micro, gas=gas, dtype=dtype)(model)

    return run_reference(model_fn, micro_losses, lr=lr, steps=steps, optimizer=optimizer, weight_decay=weight_decay,
                         grad_clip=grad_clip, dtype=dtype, loss_scale=loss_scale)


def train_reference(model_fn: Callable[[], nn.Module], batches: Sequence[Batch], *, lr: float, steps: int,
                    optimizer: str = "adamw", weight_decay: float = 0.0, grad_clip: float | None = None,
                    loss_fn: LossFn | None = None) -> tuple[list[float], dict[str, Tensor]]:
    """The per-step losses and a detached copy of the final state dict of a full-batch fp32 `reference_run`."""
    run = reference_run(model_fn, batches, lr=lr, steps=steps, optimizer=optimizer, weight_decay=weight_decay,
                        grad_clip=grad_clip, loss_fn=loss_fn)
    return run.losses, run.params

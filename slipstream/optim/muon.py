"""Muon (https://kellerjordan.github.io/posts/muon/) with an auxiliary AdamW, as DeepSpeed's
`runtime.zero.muon` MuonWithAuxAdam: param groups carry `use_muon`; hidden matrices take Muon, everything else
(1-D parameters, embeddings, the output head) AdamW.

Muon, for a matrix W with gradient g and momentum buffer m (defaults lr 0.02, momentum 0.95, 5 steps, Nesterov):
    m = lerp(m, g, 1 - momentum);  u = lerp(g, m, momentum) (Nesterov; else u = m)
    O = NS5(u) * sqrt(max(1, rows / cols))         NS5: the quintic Newton-Schulz iteration, (a, b, c) =
                                                    (3.4445, -4.7750, 2.0315), on u / (||u||_F + 1e-7)
    W *= 1 - lr weight_decay;  W -= lr O
AdamW for the rest (defaults lr 3e-4, betas (0.9, 0.95), eps 1e-10, weight_decay 0; `adam_w_mode` false: L2).

Under ZeRO the momentum is elementwise (each rank updates its pieces), but the iteration needs the matrix
whole ([Note: Muon under ZeRO] in docs/design.md): each rank puts its parts of u for the matrices no rank holds
whole into one flat buffer, ONE all-reduce brings those matrices whole to every rank, and each rank
orthogonalises the ones it holds a part of and keeps its parts. A matrix that one rank holds whole is
orthogonalised there without communication.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from slipstream.config.optimizers import is_muon_matrix
from slipstream.optim.common import WholeTensorOptimizer, apply_update, closure_loss, grad_of
from slipstream.zero.whole_tensors import WholeTensorMap

__all__ = ["MuonWithAuxAdam", "build_muon", "muon_update", "newton_schulz", "tag_muon_params"]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_METHODS = ("gram", "standard")
MUON_DEFAULTS: dict[str, object] = {
    "lr": 0.02,
    "momentum": 0.95,
    "weight_decay": 0.0,
    "ns_method": "gram",
    "ns_steps": 5,
    "nesterov": True,
}
ADAM_DEFAULTS: dict[str, object] = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0}
MUON_KEYS = tuple(MUON_DEFAULTS)
ADAM_KEYS = tuple(ADAM_DEFAULTS)


def newton_schulz(update: Tensor, steps: int) -> Tensor:
    """The quintic Newton-Schulz iteration towards the orthogonal factor of `update` (2-D; more dimensions are
    viewed as (first, rest)), in fp32, times DeepSpeed's shape scale sqrt(max(1, rows / cols)) of the last two
    dimensions."""
    a, b, c = NS_COEFFICIENTS
    rows, cols = update.shape[-2], update.shape[-1]
    x = update.reshape(update.shape[0], -1).float() if update.dim() > 2 else update.float()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.mT
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    if tall:
        x = x.mT
    return x.mul_(math.sqrt(rows / cols) if rows > cols else 1.0).reshape(update.shape)


def muon_update(
    grad: Tensor,
    momentum: Tensor,
    beta: float = 0.95,
    ns_steps: int = 5,
    nesterov: bool = True,
    ns_method: str = "gram",
    is_expert_group: bool = False,
) -> Tensor:
    """One Muon update of a whole matrix, with DeepSpeed's `original_muon.muon_update` signature: `momentum`
    becomes lerp(momentum, grad, 1 - beta) in place; u = lerp(grad, momentum, beta) (Nesterov, written into
    `grad` as DeepSpeed does) or momentum; returns NS5(u) scaled as `newton_schulz` does, in `grad`'s dtype.
    An expert group's 3-D gradient is one matrix per expert; a 4-D (convolution) one is viewed as (out, rest)."""
    if ns_method not in NS_METHODS:
        raise ValueError(f"muon_update: ns_method={ns_method!r} is not one of {NS_METHODS}")
    momentum.lerp_(grad, 1.0 - beta)
    update = grad.lerp_(momentum, beta) if nesterov else momentum
    if is_expert_group:
        out = torch.stack([newton_schulz(matrix, ns_steps) for matrix in update])
    else:
        out = newton_schulz(update, ns_steps)
        out = out.reshape(len(update), -1) if update.dim() == 4 else out
    return out.to(grad.dtype)


def tag_muon_params(module: nn.Module) -> None:
    """DeepSpeed's rule: `use_muon` on every parameter, True for matrices (2-D and up) whose name has neither
    'embed' nor 'lm_head'."""
    for name, param in module.named_parameters():
        shape = getattr(param, "ds_shape", None) or param.shape
        param.use_muon = is_muon_matrix(name, shape)  # type: ignore[attr-defined]


class MuonWithAuxAdam(WholeTensorOptimizer):
    """Muon for the param groups with `use_muon`, AdamW for the others (DeepSpeed's MuonWithAuxAdam)."""

    def __init__(self, param_groups: Iterable[dict[str, Any]], *, adam_w_mode: bool = True) -> None:
        groups = []
        for group in param_groups:
            if "use_muon" not in group:
                raise ValueError(
                    "MuonWithAuxAdam needs 'use_muon' in every param group (True: Muon, False: AdamW); "
                    f"a group with keys {sorted(group)} has none"
                )
            defaults = MUON_DEFAULTS if group["use_muon"] else ADAM_DEFAULTS
            groups.append({**defaults, **group})
            _check_group(groups[-1])
        super().__init__(groups, {})
        self.adam_w_mode = adam_w_mode

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure_loss(closure)
        whole = self.whole_tensors()
        momenta: list[tuple[dict[str, Any], Tensor, Tensor]] = []
        for group in self.param_groups:
            for p in group["params"]:
                if group["use_muon"]:
                    momenta.append((group, p, self._momentum(group, p)))
                else:
                    self._adam(group, p)
        self._orthogonal_step(whole, momenta)
        return loss

    def _momentum(self, group: dict[str, Any], p: Tensor) -> Tensor:
        """m = lerp(m, g, 1 - momentum); the update u (Nesterov: lerp(g, m, momentum)) in a scratch buffer."""
        state, grad = self.state[p], grad_of(p)
        if not state:
            state["momentum_buffer"] = torch.zeros_like(p, dtype=grad.dtype)
        momentum, beta = state["momentum_buffer"], group["momentum"]
        momentum.lerp_(grad, 1.0 - beta)
        update = self.scratch(p)
        if group["nesterov"]:
            torch.lerp(grad, momentum, beta, out=update)
        else:
            update.copy_(momentum)
        return update

    def _orthogonal_step(self, whole: WholeTensorMap, momenta: list[tuple[dict[str, Any], Tensor, Tensor]]) -> None:
        """Newton-Schulz on each Muon matrix whole (split ones gathered first), applied to this rank's parts."""
        muon_groups = {i for i, g in enumerate(self.param_groups) if g["use_muon"]}
        split = [t for t in sorted(whole.split) if whole.group_of[t] in muon_groups]
        gathered = dict(zip(split, whole.gather(split, ((p, u) for _, p, u in momenta))))
        done: dict[int, Tensor] = {}
        for group, p, update in momenta:
            flat_p, flat_update = p.view(-1), update.view(-1)  # a ZeRO piece is flat already; a parameter is not
            for part in whole.parts(p):
                if part.tensor not in done:
                    source = gathered.get(part.tensor)
                    if source is None:  # held whole here
                        source = flat_update[part.offset : part.offset + part.numel].view(whole.shapes[part.tensor])
                    on = whole.comm_device or source.device  # the accelerator, also when offload keeps p on the host
                    done[part.tensor] = newton_schulz(source.to(on), group["ns_steps"]).reshape(-1).to(p.device)
                orthogonal = done[part.tensor][part.lo : part.lo + part.numel]
                target = flat_p[part.offset : part.offset + part.numel]
                apply_update(target, orthogonal, lr=group["lr"], decay=group["weight_decay"])

    def _adam(self, group: dict[str, Any], p: Tensor) -> None:
        """One AdamW (or, without adam_w_mode, L2 Adam) step of `p`, elementwise."""
        grad = grad_of(p)
        if not self.adam_w_mode and group["weight_decay"]:
            grad = grad.add(p.to(grad.dtype), alpha=group["weight_decay"])
        update = self.adam_direction(p, grad, betas=group["betas"], eps=group["eps"])
        apply_update(p, update, lr=group["lr"], decay=group["weight_decay"] if self.adam_w_mode else 0.0)


def _check_group(group: dict[str, Any]) -> None:
    if group["use_muon"]:
        if group["ns_method"] not in NS_METHODS:
            raise ValueError(f"Muon ns_method={group['ns_method']!r} is not one of {NS_METHODS}")
        if not (isinstance(group["ns_steps"], int) and group["ns_steps"] >= 1):
            raise ValueError(f"Muon ns_steps={group['ns_steps']!r} must be an integer >= 1")
    if float(group["lr"]) < 0:
        raise ValueError(f"Muon/AdamW lr={group['lr']} must be >= 0")


def build_muon(params: Sequence[object], options: dict[str, object]) -> MuonWithAuxAdam:
    """DeepSpeed's Muon param groups from `params` (tensors tagged `use_muon`, or groups of them) and the
    config's `optimizer.params`: each incoming group split into its Muon and its AdamW half; a setting is the
    config's shared value, then `muon_lr` / `adam_lr`, then the group's own."""
    options = dict(options)
    adam_w_mode = options.pop("adam_w_mode", True)
    if not isinstance(adam_w_mode, bool):
        raise ValueError(
            f"optimizer.params.adam_w_mode must be true or false, got {adam_w_mode!r} "
            "(true: decoupled weight decay in the AdamW half, as AdamW; false: L2 decay, as Adam)"
        )
    if options.pop("per_head_muon", False):
        raise ValueError(
            "optimizer.params.per_head_muon is not implemented in Slipstream (Newton-Schulz per attention head); "
            "remove it to orthogonalise each matrix whole"
        )
    unknown = sorted(set(options) - {*MUON_KEYS, *ADAM_KEYS, "muon_lr", "adam_lr"})
    if unknown:
        raise ValueError(
            f"optimizer.params {unknown} not accepted by Muon; it accepts {sorted({*MUON_KEYS, *ADAM_KEYS})}, "
            "muon_lr, adam_lr, adam_w_mode"
        )
    halves = ((True, MUON_KEYS, "muon_lr"), (False, ADAM_KEYS, "adam_lr"))
    groups: list[dict[str, Any]] = []
    for incoming in _incoming_groups(params):
        trainable = [p for p in incoming["params"] if p.requires_grad]
        untagged = [tuple(p.shape) for p in trainable if not hasattr(p, "use_muon")]
        if untagged:
            raise ValueError(
                f"Muon needs every parameter tagged with use_muon; {len(untagged)} are not (shapes {untagged[:3]}). "
                "initialize() tags the model's own parameters: pass parameters of the model, or set p.use_muon"
            )
        for use_muon, keys, lr_key in halves:
            half = [p for p in trainable if bool(p.use_muon) is use_muon]
            if half:
                settings = {k: options[k] for k in keys if k in options}
                settings.update({"lr": options[lr_key]} if lr_key in options else {})
                settings.update({k: v for k, v in incoming.items() if k in keys})
                groups.append({"params": half, "use_muon": use_muon, **settings})
    return MuonWithAuxAdam(groups, adam_w_mode=adam_w_mode)


def _incoming_groups(params: Sequence[object]) -> list[dict[str, Any]]:
    groups = [dict(p) for p in params if isinstance(p, dict)]
    loose = [p for p in params if isinstance(p, Tensor)]
    if loose or not groups:
        groups.append({"params": loose})
    return [{**g, "params": list(g["params"])} for g in groups]

"""Top-k gating: which experts each token goes to, where it sits in the expert's buffer, with what weight.

[Note: routes]
A gate turns logits [S tokens, E experts] into k *routes* per token, kept as [k, S] tensors:
- `experts`: the expert of each route, -1 when the route was dropped (over capacity, or `used_token` 0);
- `slots`: the route's position in its expert's buffer (0 .. capacity-1);
- `weights`: the gate value the expert's output is scaled by when combined (fp32).
Dispatch and combine (layer.py) are one gather each over these; nothing [S, E, C]-sized is built.

The rules follow DeepSpeed's `top1gating` / `top2gating` / `topkgating`:
- capacity = max(ceil(S / E * capacity_factor * k), min_capacity), the product in float32; without token dropping
  it is the largest per-expert count, agreed over the expert-parallel group (all-reduce MAX), so buffers have one
  size.
- k = 1: the argmax of the softmax (of logits plus Gumbel noise with noisy_gate_policy 'RSample'); over
  capacity, `use_rts` keeps a uniformly random choice of the expert's tokens, else the first ones;
  weight = the softmax value; l_aux = E * sum(mean gate * fraction routed) per expert.
- k = 2: first choices fill each buffer before second choices (second choice: argmax of the logits without
  the first, plus Gumbel noise when `top2_2nd_expert_sampling`); over capacity the later positions drop;
  weights renormalised over the kept routes; l_aux = E^2 * mean(mean gate * fraction of first choices).
- k > 2: the k largest gates; over capacity an expert keeps the tokens with the largest gate values;
  weights renormalised over the kept routes; l_aux = E^2 / k * mean(mean gate * fraction routed).
`exp_counts` counts routes per expert before any drop (DeepSpeed's), as int64.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from slipstream.comm import collectives

NOISY_POLICIES = (None, "Jitter", "RSample")


@dataclasses.dataclass(frozen=True)
class GateRules:
    """How a gate routes: TopKGate's DeepSpeed arguments but the group, in their order and with their defaults
    (TopKGate passes them by position; see [Note: routes])."""

    k: int = 1
    capacity_factor: float = 1.0
    eval_capacity_factor: float = 1.0
    """The capacity factor out of training (`module.eval()`)."""
    min_capacity: int = 8
    noisy_gate_policy: str | None = None
    """None, "Jitter" (the gate input scaled by noise) or "RSample" (Gumbel noise on the top-1 choice); in
    training only."""
    drop_tokens: bool = True
    use_rts: bool = True
    top2_2nd_expert_sampling: bool = True

    def __post_init__(self) -> None:
        if self.noisy_gate_policy not in NOISY_POLICIES:
            raise ValueError(f"noisy_gate_policy={self.noisy_gate_policy!r}; use one of {NOISY_POLICIES}")


@dataclasses.dataclass
class Routes:
    """The gate's decision for S tokens (see [Note: routes])."""

    experts: Tensor
    slots: Tensor
    weights: Tensor
    capacity: int
    l_aux: Tensor
    exp_counts: Tensor

    @property
    def kept(self) -> Tensor:
        """Kept routes per expert ([E]); expert e's fill slots 0 .. kept[e]-1 of its buffer."""
        return torch.bincount(self.experts.reshape(-1) + 1, minlength=self.exp_counts.numel() + 1)[1:]  # -1: dropped

    @property
    def dropped(self) -> Tensor:
        """Dropped routes per expert ([E]), counted against `exp_counts`."""
        return self.exp_counts - self.kept


def capacity(num_tokens: int, num_experts: int, capacity_factor: float, k: int, min_capacity: int) -> int:
    """Buffer slots per expert when tokens are dropped: max(ceil(S / E * capacity_factor * k), min_capacity).

    The product is taken in float32, as DeepSpeed's tensors take it: 25 tokens on 2 experts at factor 1.2 are
    15.0000006 slots in float32 (16 after the ceil) but exactly 15.0 in double arithmetic.
    """
    per_expert = torch.tensor(num_tokens / num_experts, dtype=torch.float32)
    product = per_expert * torch.tensor(capacity_factor * k, dtype=torch.float32)
    return max(math.ceil(float(product)), min_capacity)


def gumbel(shape: torch.Size, device: torch.device) -> Tensor:
    uniform = torch.rand(shape, device=device).clamp_(min=1e-20, max=1.0 - 1e-7)
    return -torch.log(-torch.log(uniform))


def _choose(
    logits: Tensor, gates: Tensor, k: int, noisy_gate_policy: str | None, top2_2nd_expert_sampling: bool
) -> Tensor:
    """The k experts of every token [S, k]: top-1 (Gumbel-sampled under RSample), top-2 with a sampled second
    choice, or plain top-k."""
    if k == 1:
        chooser = logits + gumbel(logits.shape, logits.device) if noisy_gate_policy == "RSample" else gates
        return chooser.argmax(dim=1, keepdim=True)  # [S, 1]
    if k == 2:
        num_experts = logits.shape[1]
        first = gates.argmax(dim=1)
        second_logits = logits + gumbel(logits.shape, logits.device) if top2_2nd_expert_sampling else logits
        second = second_logits.masked_fill(F.one_hot(first, num_experts).bool(), float("-inf")).argmax(dim=1)
        return torch.stack([first, second], dim=1)
    return gates.topk(k, dim=1).indices


def _aux_loss(gates: Tensor, routed: Tensor, k: int) -> Tensor:
    """The load-balancing loss: mean gate probability times the fraction of routes, per expert."""
    num_experts = gates.shape[1]
    me = gates.mean(dim=0)
    if k == 1:
        return (me * routed[:, 0].float().mean(dim=0)).sum() * num_experts
    if k == 2:
        return (me * routed[:, 0].float().mean(dim=0)).mean() * num_experts * num_experts
    return (me * routed.sum(1).float().mean(dim=0)).mean() * num_experts * num_experts / k


def _slots(routed: Tensor, k: int) -> Tensor:
    """The slot [S, k] of every route in its expert's buffer: k = 1, 2 route-major (first choices first), k > 2
    in token order."""
    num_tokens, _, num_experts = routed.shape
    if k <= 2:
        order = routed.transpose(0, 1).reshape(k * num_tokens, num_experts)
        positions = (order.cumsum(dim=0) - 1).reshape(k, num_tokens, num_experts).transpose(0, 1)
    else:
        per_token = routed.sum(1)
        positions = (per_token.cumsum(dim=0) - 1).unsqueeze(1).expand(-1, k, -1)
    return (positions * routed).sum(dim=2)


def _drop_over_capacity(
    gates: Tensor, top: Tensor, routed: Tensor, live: Tensor, slot: Tensor, cap: int, use_rts: bool
) -> tuple[Tensor, Tensor]:
    """(live, slot) once each expert keeps at most `cap` routes: random tokens (top-1 with RTS), the highest
    gates (k > 2), or the first in slot order."""
    num_tokens, k, num_experts = routed.shape
    if k == 1 and use_rts:
        score = routed[:, 0].float() * torch.rand(num_tokens, num_experts, device=gates.device)
        keep_idx = score.topk(min(cap, num_tokens), dim=0).indices
        keep = torch.zeros_like(score).scatter_(0, keep_idx, 1.0) * routed[:, 0].float()
        live = live & (keep.sum(dim=1, keepdim=True) > 0)
        # kept tokens fill the buffer in token order
        kept_pos = (keep.cumsum(dim=0) - 1) * keep
        return live, kept_pos.sum(dim=1, keepdim=True).long()
    if k > 2:
        by_expert = torch.zeros_like(gates).scatter(1, top, gates.gather(1, top)) * (routed.sum(1) > 0)
        keep_idx = by_expert.topk(min(cap, num_tokens), dim=0).indices
        keep = torch.zeros_like(gates, dtype=torch.bool).scatter_(0, keep_idx, True) & (routed.sum(1) > 0)
        kept_pos = (keep.long().cumsum(dim=0) - 1) * keep
        return live & keep.gather(1, top), kept_pos.gather(1, top)
    return live & (slot < cap), slot


def _needed_capacity(exp_counts: Tensor, ep_group: dist.ProcessGroup | None, ep_size: int) -> int:
    """Without dropping: the largest expert's route count over the expert-parallel group (at least 1)."""
    needed = exp_counts.max().reshape(1).clone()
    if ep_group is not None and ep_size > 1:
        collectives.all_reduce(needed, group=ep_group, op=dist.ReduceOp.MAX)
    return max(int(needed.item()), 1)


def route(
    logits: Tensor,
    rules: GateRules,
    *,
    training: bool = True,
    used_token: Tensor | None = None,
    ep_group: dist.ProcessGroup | None = None,
    ep_size: int = 1,
) -> Routes:
    """Route S tokens with fp32 `logits` [S, E] to k experts each (see [Note: routes]) by `rules`, as in training
    or (`training=False`) as in evaluation: `eval_capacity_factor`, no noise."""
    num_tokens, num_experts = logits.shape
    k = rules.k
    if not 1 <= k <= num_experts:
        raise ValueError(f"MoE k={k} must be between 1 and num_experts={num_experts}")
    gates = F.softmax(logits, dim=1)
    noisy_gate_policy = rules.noisy_gate_policy if training else None
    top = _choose(logits, gates, k, noisy_gate_policy, rules.top2_2nd_expert_sampling)
    routed = torch.zeros(num_tokens, k, num_experts, dtype=torch.int64, device=logits.device)
    routed.scatter_(2, top.unsqueeze(2), 1)  # [S, k, E] one-hot per route
    if used_token is not None:
        routed = routed * used_token.reshape(-1, 1, 1).to(routed.dtype)
    exp_counts = routed.sum(dim=(0, 1)).detach()
    l_aux = _aux_loss(gates, routed, k)
    slot = _slots(routed, k)  # [S, k]
    live = routed.sum(dim=2) > 0  # [S, k]
    if rules.drop_tokens:
        capacity_factor = rules.capacity_factor if training else rules.eval_capacity_factor
        cap = capacity(num_tokens, num_experts, capacity_factor, k, rules.min_capacity)
        live, slot = _drop_over_capacity(gates, top, routed, live, slot, cap, rules.use_rts)
    else:
        cap = _needed_capacity(exp_counts, ep_group, ep_size)

    weights = gates.gather(1, top) * live  # [S, k]
    if k > 1:
        weights = weights / weights.sum(dim=1, keepdim=True).clamp(min=torch.finfo(weights.dtype).eps)
    expert = torch.where(live, top, torch.full_like(top, -1))
    slot = torch.where(live, slot, torch.zeros_like(slot))
    return Routes(
        experts=expert.t().contiguous(),
        slots=slot.t().contiguous(),
        weights=weights.t().contiguous(),
        capacity=cap,
        l_aux=l_aux,
        exp_counts=exp_counts,
    )


def multiplicative_jitter(x: Tensor, epsilon: float = 1e-2) -> Tensor:
    """The 'Jitter' noisy gate policy: the gate input scaled by U(1 - eps, 1 + eps) elementwise."""
    return x * torch.empty_like(x).uniform_(1.0 - epsilon, 1.0 + epsilon)

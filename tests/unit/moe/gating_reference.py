"""A plain-Python reference for DeepSpeed's top-1 / top-2 / top-k gating, written token by token from the rules of
`deepspeed.moe.sharded_moe` (noisy gating off, `drop_policy` 'probs'), to test slipstream.moe.gating against
something other than itself. No tensors: lists of floats in, lists out, every decision a visible loop.

The rules, for S tokens and E experts, gates = softmax(logits) per token:
- choices: k = 1 the largest gate; k = 2 the largest gate, then the largest *logit* among the other experts;
  k > 2 the k largest gates, largest first.
- `exp_counts[e]`: routes to e before any drop (a token with `used_token` 0 routes nowhere; top-1 only).
- capacity with drop_tokens: max(ceil(S / E * (capacity_factor * k)), min_capacity), the product taken in
  float32 as DeepSpeed's tensors do; without: the largest `exp_counts` (top-1: at most S).
- which routes an over-full expert keeps: top-1 the first ones in token order, or, given `uniform` ([S][E]
  draws, DeepSpeed's random token selection), the ones with the largest draws; top-2 all first choices in
  token order and then all second choices in token order, slots past the capacity dropped; top-k the ones
  with the largest gate values.
- slot: top-2 the position in that first-then-second order; otherwise the rank among the expert's kept
  routes in token order.
- weight: top-1 the gate; k >= 2 the gate over the sum of the token's kept gates (0 when none is kept).
- l_aux: me[e] = mean gate of e, ce[e] = fraction of tokens whose first choice (top-1, top-2) or any choice
  (top-k) is e; top-1 E * sum(me * ce), top-2 E^2 * mean(me * ce), top-k E^2 / k * mean(me * ce).
"""

from __future__ import annotations

import dataclasses
import math
import struct


@dataclasses.dataclass
class Decision:
    """The reference's routes: `routes[s][r]` is (expert, slot, weight) of token s's r-th choice, None if
    dropped (or never routed: `used_token` 0)."""

    routes: list[list[tuple[int, int, float] | None]]
    capacity: int
    exp_counts: list[int]
    l_aux: float


def float32(x: float) -> float:
    """x rounded to the nearest float32."""
    return struct.unpack("f", struct.pack("f", x))[0]


def capacity(num_tokens: int, num_experts: int, capacity_factor: float, k: int, min_capacity: int) -> int:
    """DeepSpeed's `_capacity`: float32(S / E) times float32(capacity_factor * k), rounded to float32, ceil."""
    product = float32(float32(num_tokens / num_experts) * float32(capacity_factor * k))
    return max(math.ceil(product), min_capacity)


def softmax(row: list[float]) -> list[float]:
    top = max(row)
    exps = [math.exp(x - top) for x in row]
    total = sum(exps)
    return [x / total for x in exps]


def argmax(values: list[float], skip: int = -1) -> int:
    best = -1
    for i, v in enumerate(values):
        if i != skip and (best < 0 or v > values[best]):
            best = i
    return best


def choices(logits: list[float], gates: list[float], k: int) -> list[int]:
    """The experts of one token's routes, in route order."""
    if k == 1:
        return [argmax(gates)]
    if k == 2:
        first = argmax(gates)
        return [first, argmax(logits, skip=first)]
    return sorted(range(len(gates)), key=lambda e: -gates[e])[:k]


def load_balancing_loss(gates: list[list[float]], chosen: list[list[int]], k: int) -> float:
    num_tokens, num_experts = len(gates), len(gates[0])
    me = [sum(g[e] for g in gates) / num_tokens for e in range(num_experts)]
    counted = [0] * num_experts
    for mine in chosen:
        for e in mine if k > 2 else mine[:1]:  # top-1 and top-2 count first choices only
            if e >= 0:
                counted[e] += 1
    ce = [c / num_tokens for c in counted]
    dot = sum(m * c for m, c in zip(me, ce))
    if k == 1:
        return num_experts * dot
    mean = dot / num_experts
    if k == 2:
        return num_experts * num_experts * mean
    return num_experts * num_experts / k * mean


def fill_order(chosen: list[list[int]], k: int) -> list[tuple[int, int]]:
    """(token, route) pairs in the order they claim slots: top-2 every first choice before any second choice."""
    if k == 2:
        return [(s, r) for r in range(2) for s in range(len(chosen))]
    return [(s, r) for s in range(len(chosen)) for r in range(k)]


def kept_routes(
    chosen: list[list[int]],
    gates: list[list[float]],
    *,
    k: int,
    cap: int,
    uniform: list[list[float]] | None,
) -> set[tuple[int, int]]:
    """The (token, route) pairs that fit in their expert's `cap` slots."""
    num_experts = len(gates[0])
    if k == 2:  # slots are claimed first-then-second; the ones past the capacity drop
        claimed = [0] * num_experts
        kept = set()
        for s, r in fill_order(chosen, k):
            if chosen[s][r] >= 0:
                if claimed[chosen[s][r]] < cap:
                    kept.add((s, r))
                claimed[chosen[s][r]] += 1
        return kept
    kept = set()
    for e in range(num_experts):
        mine = [(s, r) for s in range(len(chosen)) for r in range(k) if chosen[s][r] == e]
        if k == 1 and uniform is not None:
            mine.sort(key=lambda sr: -uniform[sr[0]][e])
        elif k > 2:
            mine.sort(key=lambda sr: -gates[sr[0]][e])
        kept.update(mine[:cap])
    return kept


def gate(
    logits: list[list[float]],
    *,
    k: int,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    used_token: list[float] | None = None,
    uniform: list[list[float]] | None = None,
) -> Decision:
    """Route every token of `logits` ([S][E]) by DeepSpeed's rules (see the module docstring)."""
    num_tokens, num_experts = len(logits), len(logits[0])
    gates = [softmax(row) for row in logits]
    chosen = [choices(row, g, k) for row, g in zip(logits, gates)]
    if used_token is not None:  # an unused token routes nowhere, and counts nowhere
        chosen = [c if used_token[s] else [-1] * k for s, c in enumerate(chosen)]
    exp_counts = [sum(c.count(e) for c in chosen) for e in range(num_experts)]
    if drop_tokens:
        cap = capacity(num_tokens, num_experts, capacity_factor, k, min_capacity)
    else:
        cap = min(max(exp_counts), num_tokens) if k == 1 else max(exp_counts)
    kept = kept_routes(chosen, gates, k=k, cap=cap, uniform=uniform if drop_tokens else None)
    slots: dict[tuple[int, int], int] = {}
    filled = [0] * num_experts
    for s, r in fill_order(chosen, k):
        # top-2: the slot claimed, dropped or not; the others: the rank among the kept, in token order
        counts = chosen[s][r] >= 0 if k == 2 else (s, r) in kept
        if counts:
            slots[(s, r)] = filled[chosen[s][r]]
            filled[chosen[s][r]] += 1
    routes: list[list[tuple[int, int, float] | None]] = []
    for s in range(num_tokens):
        mine = [r for r in range(k) if (s, r) in kept]
        total = sum(gates[s][chosen[s][r]] for r in mine)
        row: list[tuple[int, int, float] | None] = [None] * k
        for r in mine:
            weight = gates[s][chosen[s][r]] if k == 1 else gates[s][chosen[s][r]] / total
            row[r] = (chosen[s][r], slots[(s, r)], weight)
        routes.append(row)
    l_aux = load_balancing_loss(gates, chosen, k)
    return Decision(routes=routes, capacity=cap, exp_counts=exp_counts, l_aux=l_aux)

"""How a PipelineModule's layers are split into stages: DeepSpeed's "uniform", "parameters", "type:<regex>",
and an explicit list of boundaries. A partition is `parts` with `parts[s]:parts[s+1]` the layers of stage s."""

from __future__ import annotations

import re
from collections.abc import Sequence


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Equal counts, the remainder spread over the first parts."""
    base, extra = divmod(num_items, num_parts)
    parts = [0]
    for p in range(num_parts):
        parts.append(parts[-1] + base + (1 if p < extra else 0))
    return parts


def partition_balanced(weights: Sequence[int], num_parts: int) -> list[int]:
    """Contiguous parts minimising the heaviest part (binary search over the bottleneck, greedy fill);
    every part gets at least one item when there are enough items."""
    n = len(weights)
    if n < num_parts:
        return partition_uniform(n, num_parts)

    def split(limit: int) -> list[int] | None:
        parts, total = [0], 0
        for i, w in enumerate(weights):
            left_items, left_parts = n - i, num_parts - (len(parts) - 1)
            if (total + w > limit and i > parts[-1]) or left_items < left_parts:
                if len(parts) == num_parts:
                    return None
                parts.append(i)
                total = 0
            total += w
        if total > limit:
            return None
        parts += [n] * (num_parts + 1 - len(parts))
        return parts

    lo, hi = max(weights, default=0), max(sum(weights), 1)
    best = split(hi) or partition_uniform(n, num_parts)
    while lo < hi:
        mid = (lo + hi) // 2
        found = split(mid)
        if found is not None:
            best, hi = found, mid
        else:
            lo = mid + 1
    return best


def partition(
    method: str | Sequence[int],
    *,
    num_layers: int,
    num_parts: int,
    param_counts: Sequence[int],
    type_names: Sequence[str],
) -> list[int]:
    """The boundaries for `method`; an explicit list is checked (num_parts + 1 increasing values 0..num_layers)."""
    if not isinstance(method, str):
        parts = list(method)
        if len(parts) != num_parts + 1 or parts[0] != 0 or parts[-1] != num_layers or parts != sorted(parts):
            raise ValueError(
                f"partition_method={parts} must be {num_parts + 1} non-decreasing boundaries from 0 to "
                f"{num_layers} (the layers of stage s are parts[s]:parts[s+1])"
            )
        return parts
    lowered = method.lower()
    if lowered == "uniform":
        return partition_uniform(num_layers, num_parts)
    if lowered == "parameters":
        return partition_balanced(list(param_counts), num_parts)
    if lowered.startswith("type:"):
        pattern = re.compile(method.split(":", 1)[1], re.IGNORECASE)
        marks = [1 if pattern.search(name) else 0 for name in type_names]
        if not any(marks):
            raise ValueError(f"partition_method={method!r} matches no layer type (types: {sorted(set(type_names))})")
        return partition_balanced(marks, num_parts)
    raise ValueError(
        f"partition_method={method!r} is not known; use 'parameters', 'uniform', 'type:<regex>' or a list of boundaries"
    )

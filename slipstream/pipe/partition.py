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
    """Contiguous parts minimising the heaviest part, then, among those, maximising the lightest one; ties go to
    the earliest boundaries placed as late as possible (fill the first parts). Every part gets at least one item
    when there are enough items."""
    n = len(weights)
    if n < num_parts:
        return partition_uniform(n, num_parts)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    heaviest = _lightest_bottleneck(weights, num_parts)
    # light[j][i]: the largest lightest part over splits of items 0..i-1 into j parts of at most `heaviest` each
    unset = -1
    light = [[unset] * (n + 1) for _ in range(num_parts + 1)]
    light[0][0] = prefix[-1] + 1  # no part yet: no lower bound
    for j in range(1, num_parts + 1):
        for i in range(j, n + 1):
            best = unset
            for k in range(i - 1, j - 2, -1):
                part = prefix[i] - prefix[k]
                if part > heaviest:
                    break
                if light[j - 1][k] != unset:
                    best = max(best, min(light[j - 1][k], part))
            light[j][i] = best
    lightest = light[num_parts][n]
    # fits[j][i]: items i..n-1 split into j parts, each between `lightest` and `heaviest`
    fits = [[False] * (n + 1) for _ in range(num_parts + 1)]
    fits[0][n] = True
    for j in range(1, num_parts + 1):
        for i in range(n - 1, -1, -1):
            for k in range(i + 1, n + 1):
                part = prefix[k] - prefix[i]
                if part > heaviest:
                    break
                if part >= lightest and fits[j - 1][k]:
                    fits[j][i] = True
                    break
    parts = [0]
    for left in range(num_parts - 1, 0, -1):
        start = parts[-1]
        parts.append(
            max(
                k
                for k in range(start + 1, n + 1)
                if fits[left][k] and lightest <= prefix[k] - prefix[start] <= heaviest
            )
        )
    return [*parts, n]


def _lightest_bottleneck(weights: Sequence[int], num_parts: int) -> int:
    """The smallest possible heaviest part over splits into `num_parts` non-empty contiguous parts (n >= parts):
    binary search over the bound, each bound checked by a greedy fill."""
    n = len(weights)

    def fits(limit: int) -> bool:
        parts, total = 1, 0
        for i, w in enumerate(weights):
            if w > limit:
                return False
            must_cut = n - i <= num_parts - parts  # the items left are just enough for the parts left
            if total and (total + w > limit or must_cut):
                parts, total = parts + 1, 0
            total += w
        return parts <= num_parts

    lo, hi = max(weights, default=0), max(sum(weights), 0)
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


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

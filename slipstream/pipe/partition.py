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


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Contiguous parts whose heaviest part is as light as possible and, among those, whose lightest part is
    as heavy as possible (so the parts' weights differ as little as that allows); ties keep the earlier
    parts full. Every part gets at least one item when there are enough items."""
    n = len(weights)
    if n < num_parts:
        return partition_uniform(n, num_parts)
    heaviest = max(_part_sums(weights, _bottleneck_parts(weights, num_parts, n)))
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    low, high, lightest = 0.0, float(heaviest), 0.0
    for _ in range(60):  # bisection on the lightest part's weight; `lightest` stays feasible
        mid = (low + high) / 2
        if _suffix_table(prefix, num_parts, mid, heaviest) is not None:
            lightest, low = mid, mid
        else:
            high = mid
        if high - low <= 1e-9 * max(1.0, abs(high)):
            break
    table = _suffix_table(prefix, num_parts, lightest, heaviest)
    if table is None:  # not reached: lightest=0 is always feasible
        return _bottleneck_parts(weights, num_parts, n)
    parts = [0]
    for k in range(num_parts, 0, -1):  # each part as long as the rest can still be split
        start = parts[-1]
        end = max(
            e for e in range(start + 1, n + 1) if lightest <= prefix[e] - prefix[start] <= heaviest and table[k - 1][e]
        )
        parts.append(end)
    return parts


def _part_sums(weights: Sequence[float], parts: list[int]) -> list[float]:
    return [sum(weights[a:b]) for a, b in zip(parts, parts[1:])]


def _suffix_table(prefix: list[float], num_parts: int, low: float, high: float) -> list[list[bool]] | None:
    """table[k][i]: items i.. split into k non-empty parts each weighing within [low, high]; None when the
    whole list cannot be split into num_parts such parts."""
    import bisect

    n = len(prefix) - 1
    table = [[i == n for i in range(n + 1)]]
    for _ in range(num_parts):
        below = table[-1]
        counts = [0]
        for flag in below:
            counts.append(counts[-1] + flag)
        row = []
        for i in range(n + 1):
            first = max(i + 1, bisect.bisect_left(prefix, prefix[i] + low))
            last = bisect.bisect_right(prefix, prefix[i] + high) - 1
            row.append(first <= last and counts[last + 1] - counts[first] > 0)
        table.append(row)
    return table if table[num_parts][0] else None


def _bottleneck_parts(weights: Sequence[float], num_parts: int, n: int) -> list[int]:
    """A partition whose heaviest part is as light as possible (binary search over it, greedy fill)."""

    def split(limit: float) -> list[int] | None:
        parts, total = [0], 0.0
        for i, w in enumerate(weights):
            left_items, left_parts = n - i, num_parts - (len(parts) - 1)
            if (total + w > limit and i > parts[-1]) or left_items < left_parts:
                if len(parts) == num_parts:
                    return None
                parts.append(i)
                total = 0.0
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

"""Which kept candidate runs next (`autotuning.tuner_type`).

- `gridsearch`: the ranking's order (select.py: those predicted to fit, best estimate first).
- `random`: the kept candidates in a seeded random order (the same seed, the same order).
- `model_based`: DeepSpeed's meaning, a cost model fitted on the trials run so far picks the next candidate.
  Here the model is the ranking's estimate corrected by a fitted factor: after every trial that measured a
  throughput, `log(measured / estimate)` is fitted by ridge least squares on the candidate's features (ZeRO
  stage, optimizer and parameter offload, NVMe, activation checkpointing, log2 of the micro batch, and a free
  intercept), and the next candidate is the untried one with the highest `estimate * exp(fit)`. Before any
  measurement the fit is zero and the order is the ranking's.
Every order ends when its candidates are all tried; the tuner also stops at its trial limit and early stopping.
"""

from __future__ import annotations

import math
import random
from typing import Protocol

from slipstream.autotuning.select import Ranked

__all__ = ["RIDGE", "TUNER_TYPES", "Order", "features", "fit", "make_order"]

TUNER_TYPES = ("gridsearch", "random", "model_based")
RIDGE = 1e-2
"""The ridge penalty of the feature weights (the intercept is free): with few trials the fit stays small."""


class Order(Protocol):
    def next(self) -> Ranked | None:
        """The next candidate to run (None: all tried)."""
        ...

    def observe(self, item: Ranked, throughput: float | None) -> None:
        """The trial of `item` measured `throughput` samples/s (None: it failed)."""
        ...


class _Fixed:
    """A fixed order decided before any trial (gridsearch, random)."""

    def __init__(self, items: list[Ranked]) -> None:
        self.items = list(items)

    def next(self) -> Ranked | None:
        return self.items.pop(0) if self.items else None

    def observe(self, item: Ranked, throughput: float | None) -> None:
        return None


def features(item: Ranked) -> list[float]:
    c = item.candidate
    return [
        1.0,
        c.stage / 3,
        float(c.offload_optimizer),
        float(c.offload_param),
        float(c.offload_device == "nvme"),
        float(bool(c.activation_checkpointing)),
        math.log2(c.micro_batch),
    ]


def _solve(matrix: list[list[float]], vector: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (the ridge makes `matrix` positive definite)."""
    n = len(vector)
    rows = [row[:] + [value] for row, value in zip(matrix, vector, strict=True)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(rows[r][col]))
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(col + 1, n):
            factor = rows[r][col] / rows[col][col]
            rows[r] = [a - factor * b for a, b in zip(rows[r], rows[col], strict=True)]
    solution = [0.0] * n
    for r in reversed(range(n)):
        tail = sum(rows[r][k] * solution[k] for k in range(r + 1, n))
        solution[r] = (rows[r][n] - tail) / rows[r][r]
    return solution


def fit(samples: list[tuple[list[float], float]]) -> list[float]:
    """Ridge least squares weights of `samples` (features, target); the first feature (the intercept) is not
    penalised, the others by `RIDGE`."""
    n = len(samples[0][0])
    matrix = [[sum(x[i] * x[j] for x, _ in samples) + (RIDGE if i == j else 0.0) for j in range(n)] for i in range(n)]
    matrix[0][0] += 1e-9 - RIDGE  # the intercept stays free (a tiny term keeps it solvable)
    vector = [sum(x[i] * y for x, y in samples) for i in range(n)]
    return _solve(matrix, vector)


class _ModelBased:
    """Picks the untried candidate the refitted model predicts fastest (see the module's docstring)."""

    def __init__(self, items: list[Ranked]) -> None:
        self.untried = list(items)
        self.samples: list[tuple[list[float], float]] = []
        self.weights = [0.0] * len(features(items[0])) if items else []
        self.fits = 0

    def predicted(self, item: Ranked) -> float:
        return item.estimate * math.exp(sum(w * x for w, x in zip(self.weights, features(item), strict=True)))

    def next(self) -> Ranked | None:
        if not self.untried:
            return None
        best = max(self.untried, key=self.predicted)  # ties: the ranking's order (max keeps the first)
        self.untried.remove(best)
        return best

    def observe(self, item: Ranked, throughput: float | None) -> None:
        if throughput is None or throughput <= 0 or item.estimate <= 0:
            return
        self.samples.append((features(item), math.log(throughput / item.estimate)))
        self.weights = fit(self.samples)
        self.fits += 1


def make_order(tuner_type: str, kept: list[Ranked], *, seed: int) -> Order:
    """The order of `tuner_type` over `kept` (the ranking's order)."""
    if tuner_type == "gridsearch":
        return _Fixed(kept)
    if tuner_type == "random":
        shuffled = list(kept)
        random.Random(seed).shuffle(shuffled)
        return _Fixed(shuffled)
    if tuner_type == "model_based":
        return _ModelBased(kept)
    raise ValueError(f"autotuning.tuner_type={tuner_type!r} is not one of {', '.join(TUNER_TYPES)}")

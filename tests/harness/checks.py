"""What a rank reads out of an engine for parity checks, and the parent's comparison with the reference.

Owns `owned_state` (run in a rank: the fp32 master weights and optimizer state slices this rank holds, as
checkpoints see them, zero/slices.py) and `assert_slices_match` (run in the parent: every slice equals the
same range of the reference's tensor, and the ranks' slices together cover every element).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

Slice = tuple[str, int, int, Tensor]  # (parameter name, lo, hi, values of the flat range [lo, hi))


def owned_state(engine: Any, keys: Sequence[str] = ()) -> dict[str, list[Slice]]:
    """This rank's fp32 master slices ("master") and optimizer state slices (one entry per key in `keys`)."""
    out: dict[str, list[Slice]] = {"master": [], **{key: [] for key in keys}}
    optimizer = engine.optimizer
    with engine._resident():  # NVMe offload: parameter shards, masters and states are read back into memory
        for piece in optimizer.owned_slices(engine._param_names, for_save=False):
            out["master"].append((piece.name, piece.lo, piece.hi, piece.master.detach().float().clone()))
            state = optimizer.optimizer.state[piece.piece]
            for key in keys:
                out[key].append((piece.name, piece.lo, piece.hi, piece.state_view(state, key).float().clone()))
    return out


def assert_slices_match(per_rank: Iterable[Iterable[Slice]], reference: Mapping[str, Tensor], *, rtol: float,
                        atol: float, where: str) -> None:
    """Each slice equals reference[name].flatten()[lo:hi]; together they cover every element of every tensor."""
    covered = {name: torch.zeros(value.numel(), dtype=torch.bool) for name, value in reference.items()}
    for slices in per_rank:
        for name, lo, hi, value in slices:
            torch.testing.assert_close(value, reference[name].float().reshape(-1)[lo:hi], rtol=rtol, atol=atol,
                                       msg=lambda m, name=name, lo=lo, hi=hi: f"{where} {name}[{lo}:{hi}]: {m}")
            covered[name][lo:hi] = True
    missing = sorted(name for name, mask in covered.items() if not bool(mask.all()))
    assert not missing, f"{where}: no rank holds all of {missing}"

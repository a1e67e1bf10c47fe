"""ZeRO++ LoCo: error feedback for qgZ's quantizations (zero_optimization.zeropp_loco_param).

[Note: LoCo error feedback]
Each quantization qgZ makes (stage3/quantized_reduce.py, [Note: qgZ schedule]) is of one piece: in phase 1 the
rows bound for one node-mate, in phase 2 the node's sum bound for one node. LoCo keeps, per rank, an error e
for every piece of every unit, and with err_beta b each quantization becomes
    c = x + e                                   (x: the piece as it is; c: the compensated piece)
    q = quantize(c)                             (what is sent, int4 or int8 as in plain qgZ)
    e <- b e + (1 - b) (c - dequantize(q))      (a moving average of the compression error)
so what one reduction leaves out of a piece is sent, in part, with the next. This is the update of DeepSpeed's
`loco_swizzle_quant` / `loco_quantized_reduction` kernels (v0.14-v0.18) and of the LoCo paper ("LoCo:
Low-Bit Communication Adaptor for Large-scale Model Training"). As in DeepSpeed, e is kept between reductions
as block-wise int8 (zero/quantized.py: a byte per element and an fp32 scale per block of 256), so the kept errors
cost about a quarter of an fp32 copy of the unit's gradient (phase 1: all n x W rows of the staging buffer;
phase 2: the b x W rows of the node's sum); they are allocated at the unit's first reduction and reused. Before
every reset_T-th reduction of a unit (the 0-th, then reset_T, 2 reset_T, ...) its kept errors go back to zero.
DeepSpeed counted reductions in one counter shared by every tensor of the model (and reset once it exceeded
reset_T); here each unit counts its own, so the period does not depend on how many units the model has. The
kept errors are not saved in checkpoints (DeepSpeed kept them as attributes of the parameters, which its
checkpoints do not hold either): a run resumed from a checkpoint starts them at zero.
"""

from __future__ import annotations

import torch

from slipstream.config.plan import LocoPlan
from slipstream.zero.quantized import QuantizedRows
from slipstream.zero.stage3.pool import BufferPool

__all__ = ["KeptErrors", "LocoReduction"]

KEPT_BITS = 8


class LocoReduction:
    """The kept errors of one reduction of one unit (see [Note: LoCo error feedback]): `encode` stands for
    `codec.encode` in each phase."""

    def __init__(self, rows: dict[tuple[str, int], torch.Tensor], beta: float, pool: BufferPool) -> None:
        self._rows, self.beta, self.pool = rows, beta, pool

    def kept(self, phase: str, count: int, numel: int, device: torch.device) -> torch.Tensor:
        """The int8 rows ([count, row bytes]) of the errors kept for `phase`'s `count` pieces of `numel`."""
        key = (phase, numel)
        if key not in self._rows:
            layout = QuantizedRows(numel, bits=KEPT_BITS, tagged=False)
            self._rows[key] = torch.zeros(count, layout.row_bytes, dtype=torch.int8, device=device)
        return self._rows[key]

    def encode(
        self, codec: QuantizedRows, values: torch.Tensor, row: torch.Tensor, kept: torch.Tensor, scratch: torch.Tensor
    ) -> None:
        """Quantize `values` + the error in `kept` (one int8 row) into `row`, and keep the new error there."""
        store = QuantizedRows(codec.numel, bits=KEPT_BITS, tagged=False)
        work = self.pool.take(2 * codec.padded, torch.float32)
        compensated, error = work[: codec.numel], work[codec.padded : codec.padded + codec.numel]
        error.copy_(store.decode(kept.view(1, -1), scratch)[0])
        compensated.view(values.shape).copy_(values)
        compensated.add_(error)
        codec.encode(compensated, row, None, scratch)
        compensated.sub_(codec.decode(row.view(1, -1), scratch)[0])
        error.mul_(self.beta).add_(compensated, alpha=1.0 - self.beta)
        store.encode(error, kept, None, scratch)
        self.pool.give(work)


class KeptErrors:
    """A unit's LoCo state: kept errors per (width, dtype) of its reductions (torch_autocast's dtype parts each
    have theirs) and how many reductions each has had."""

    def __init__(self, plan: LocoPlan, pool: BufferPool) -> None:
        self.plan, self.pool = plan, pool
        self._rows: dict[tuple[int, torch.dtype], dict[tuple[str, int], torch.Tensor]] = {}
        self.reductions: dict[tuple[int, torch.dtype], int] = {}

    def start(self, width: int, dtype: torch.dtype) -> LocoReduction:
        """The next reduction of `width` elements per rank in `dtype`; its kept errors are zeroed first when it is
        a reset_T-th one."""
        key = (width, dtype)
        done = self.reductions.get(key, 0)
        rows = self._rows.setdefault(key, {})
        if done and done % self.plan.reset_every == 0:
            for kept in rows.values():
                kept.zero_()
        self.reductions[key] = done + 1
        return LocoReduction(rows, self.plan.err_beta, self.pool)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for rows in self._rows.values() for t in rows.values())

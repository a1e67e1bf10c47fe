"""`Experts`: the local experts of one MoE layer, computed together.

[Note: grouped expert computation]
The L local experts are copies of one module with their own parameters. Their buffers hold tokens padded to
one capacity, [L, T, M], so they run as one batched call: the experts' parameters are stacked ([L, ...]) and
the module's forward is vmapped over the stack (`torch.func.functional_call`), which turns each Linear into
one batched matmul over the L experts instead of L small ones. A module vmap cannot trace (data-dependent
control flow, in-place ops on its input) falls back to a loop over the experts, once, with a warning.
On the CPU there is no kernel launch to save, and stacking the parameters (forward) and splitting their
gradients (backward) costs more than the loop saves: measured on 2 cores, 8 experts x 128 -> 256 -> 128 over
512 tokens, forward + backward CPU time top-1 7.7 ms vmapped vs 7.1 ms looped (DeepSpeed's loop 7.3 ms), top-2
15.9 vs 13.3 ms. So the experts are batched on accelerators and looped on the CPU (`batch_experts` overrides).

[Note: filled rows only]
A buffer of C slots per expert is padded: at top-1 with capacity_factor 1.25 a fifth of its rows hold no token,
and without token dropping C is the largest count, so most rows of the other experts are padding. The loop
path computes only the filled rows: the layer passes `filled` [ep, L] (rows in use in each source rank's block
of each local expert; the gate fills slots 0 .. n-1, [Note: routes]), the rows are gathered into one
expert-major tensor, each expert runs on its own contiguous chunk, and the outputs are written back into a
zero buffer of the padded shape (the combine never reads padded rows). Each expert's row count is rounded up to
a multiple of ROW_GRANULE (32) with padding rows: counts change every step, and tensors of ever-new sizes made
glibc's heap keep ~20% more. Measured (bench/moe.py --size large, top-1, CPU time per step of the slower rank,
two runs each): every row computed 724-728 ms, peak RSS per rank 902-942 MiB; filled rows exactly 682-692 ms,
1128-1151 MiB; rounded to 16, 32 or 64 rows 691-708 ms, 919-963 MiB (the dense model: 609 ms). One process,
8 experts of 256 -> 1024 -> 256 over 1024 tokens: forward + backward 55 -> 47 ms CPU (exact filled rows).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn

from slipstream.utils.logging import warn_once

ROW_GRANULE = 32
"""The loop path computes each expert's filled rows rounded up to a multiple of this ([Note: filled rows only])."""


def mark_expert_params(module: nn.Module, group_name: str) -> None:
    """DeepSpeed's marks on expert parameters: not all-reduced over the data-parallel group, but over
    the expert-data-parallel group `group_name`."""
    for param in module.parameters():
        param.allreduce = False  # type: ignore[attr-defined]
        param.group_name = group_name  # type: ignore[attr-defined]


class Experts(nn.Module):
    """DeepSpeed's `deepspeed.moe.experts.Experts`: `deepspeed_experts[i]` is local expert i."""

    def __init__(self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: str | None = None) -> None:
        super().__init__()
        self.deepspeed_experts = nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local_experts)])
        self.num_local_experts = num_local_experts
        self.batch_experts: bool | None = None
        """Run the experts as one vmapped call (True) or one by one (False); None: batched on accelerators, one by
        one on the CPU, where stacking the parameters costs more than the loop (see the Note)."""
        self._grouped: bool | None = None  # None: not tried yet
        self._z3_group_key = expert_group_name or "ep_size_1"  # ZeRO-3 shards these over their group
        for local in self.deepspeed_experts:
            mark_expert_params(local, expert_group_name or "ep_size_1")

    def forward(self, inputs: Tensor, filled: Tensor | None = None) -> Tensor:
        """DeepSpeed's layout: `inputs` [ep, L, C, M] (or [L, C, M]); expert i takes [:, i]. `filled` [ep, L]:
        the rows in use in each block (see [Note: filled rows only]); None: every row is computed."""
        if inputs.dim() == 3:
            return self.grouped(inputs, filled)
        ep, local, cap, model = inputs.shape
        out = self.grouped(inputs.transpose(0, 1).reshape(local, ep * cap, model), filled)
        return out.reshape(local, ep, cap, -1).transpose(0, 1)

    def batched(self, device: torch.device) -> bool:
        """Whether the experts run as one vmapped call on `device` (computing every row) or one by one."""
        return self.batch_experts if self.batch_experts is not None else device.type != "cpu"

    def grouped(self, x: Tensor, filled: Tensor | None = None) -> Tensor:
        """Every local expert on its own rows: x [L, T, M] -> [L, T, M_out], T = ep blocks of C slots; with
        `filled` [ep, L] only the first filled[j, l] rows of block j of expert l are computed."""
        batch = self.batched(x.device)
        if filled is not None and not batch:
            return self._filled_rows(x, filled)
        if self.num_local_experts == 1:
            return _first(self.deepspeed_experts[0](x[0])).unsqueeze(0)
        if batch and self._grouped is not False:
            try:
                out = self._vmapped(x)
                self._grouped = True
                return out
            except Exception as exc:
                if self._grouped:
                    raise
                self._grouped = False
                warn_once(
                    f"moe-loop:{type(self.deepspeed_experts[0]).__name__}",
                    f"slipstream MoE: the expert module {type(self.deepspeed_experts[0]).__name__} cannot be "
                    f"batched with torch.func.vmap ({type(exc).__name__}: {exc}); its experts run one by one",
                )
        # unbind, not x[i]: one backward node for all experts (x[i]'s backward writes a zero tensor of x's size each)
        return torch.stack([_first(e(rows)) for rows, e in zip(x.unbind(0), self.deepspeed_experts)])

    def _filled_rows(self, x: Tensor, filled: Tensor) -> Tensor:
        local, rows, model = x.shape
        ep = filled.shape[0]
        cap = rows // ep
        in_use = (torch.arange(cap, device=x.device) < filled.t().to(x.device).unsqueeze(-1)).reshape(local, rows)
        # each expert's count rounded up to a multiple of ROW_GRANULE with padding rows (zeros; never combined)
        count = filled.sum(0).to(x.device)  # rows in use per expert, over the source blocks
        extra = torch.clamp((count + ROW_GRANULE - 1) // ROW_GRANULE * ROW_GRANULE, max=rows) - count
        free = ~in_use
        in_use |= free & (free.cumsum(1) <= extra.unsqueeze(1))
        index = in_use.reshape(-1).nonzero().squeeze(1)  # expert-major, then source block, then slot
        compact = x.reshape(local * rows, model).index_select(0, index)
        sizes = (count + extra).tolist()
        outs = [_first(e(chunk)) for chunk, e in zip(compact.split(sizes), self.deepspeed_experts)]
        out = torch.cat(outs)
        return out.new_zeros(local * rows, out.shape[-1]).index_copy(0, index, out).reshape(local, rows, -1)

    def _vmapped(self, x: Tensor) -> Tensor:
        experts = list(self.deepspeed_experts)
        named = [dict(e.named_parameters()) for e in experts]
        params = {name: torch.stack([n[name] for n in named]) for name in named[0]}
        buffers_by = [dict(e.named_buffers()) for e in experts]
        buffers = {name: torch.stack([b[name] for b in buffers_by]) for name in buffers_by[0]}
        base = experts[0]

        def one(p: dict[str, Tensor], b: dict[str, Tensor], rows: Tensor) -> Any:
            return _first(torch.func.functional_call(base, (p, b), (rows,)))

        out: Tensor = torch.func.vmap(one, randomness="different")(params, buffers, x)
        return out


def _first(output: Tensor | tuple[Tensor, ...]) -> Tensor:
    """Expert modules may return a tuple (DeepSpeed takes the first element)."""
    return output[0] if isinstance(output, tuple) else output

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
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn

from slipstream.utils.logging import warn_once


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

    def forward(self, inputs: Tensor) -> Tensor:
        """DeepSpeed's layout: `inputs` [ep, L, C, M] (or [L, C, M]); expert i takes [:, i]."""
        if inputs.dim() == 3:
            return self.grouped(inputs)
        ep, local, cap, model = inputs.shape
        out = self.grouped(inputs.transpose(0, 1).reshape(local, ep * cap, model))
        return out.reshape(local, ep, cap, -1).transpose(0, 1)

    def grouped(self, x: Tensor) -> Tensor:
        """Every local expert on its own rows: x [L, T, M] -> [L, T, M_out]."""
        if self.num_local_experts == 1:
            return _first(self.deepspeed_experts[0](x[0])).unsqueeze(0)
        batch = self.batch_experts if self.batch_experts is not None else x.device.type != "cpu"
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


def _first(output: Any) -> Tensor:
    """Expert modules may return a tuple (DeepSpeed takes the first element)."""
    return output[0] if isinstance(output, tuple) else output

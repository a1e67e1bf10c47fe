"""A tiny model with one MoE layer, built identically in the single-process reference (ep_size 1, every expert
local) and in each rank (its ep_size share of the experts): expert e's initial values depend only on e."""

from __future__ import annotations

import torch
from torch import nn

IN, HIDDEN, OUT, EXPERTS = 6, 8, 3, 4
L_AUX_COEF = 0.01


class TinyMoE(nn.Module):
    def __init__(
        self,
        *,
        ep_size: int = 1,
        ep_rank: int = 0,
        k: int = 1,
        drop_tokens: bool = True,
        num_experts: int = EXPERTS,
        min_capacity: int = 2,
    ) -> None:
        from slipstream.moe.layer import MoE

        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(IN, HIDDEN)
        expert = nn.Sequential(nn.Linear(HIDDEN, 12), nn.GELU(), nn.Linear(12, HIDDEN))
        self.moe = MoE(
            HIDDEN,
            expert,
            num_experts=num_experts,
            ep_size=ep_size,
            k=k,
            capacity_factor=1.0,
            min_capacity=min_capacity,
            drop_tokens=drop_tokens,
            use_rts=False,
            top2_2nd_expert_sampling=False,
        )
        self.out = nn.Linear(HIDDEN, OUT)
        local = num_experts // ep_size
        with torch.no_grad():
            for i, module in enumerate(self.moe.deepspeed_moe.experts.deepspeed_experts):
                generator = torch.Generator().manual_seed(1000 + ep_rank * local + i)
                for param in module.parameters():
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.inp(x)
        y, l_aux, _ = self.moe(h)
        return self.out(y + h), l_aux

    @staticmethod
    def loss(output: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
        prediction, l_aux = output
        return torch.nn.functional.mse_loss(prediction, target) + L_AUX_COEF * l_aux


def batches(steps: int, world: int, per_rank: int, seed: int = 0) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """batches[step][rank] = (inputs, targets)."""
    generator = torch.Generator().manual_seed(seed)
    return [
        [
            (torch.randn(per_rank, IN, generator=generator), torch.randn(per_rank, OUT, generator=generator))
            for _ in range(world)
        ]
        for _ in range(steps)
    ]


def expert_names(model: nn.Module, names: dict[int, str]) -> dict[str, torch.Tensor]:
    return {names[id(p)]: p.detach().clone() for p in model.parameters()}

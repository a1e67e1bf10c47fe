"""`MoE`: DeepSpeed's `deepspeed.moe.layer.MoE`, a mixture-of-experts layer with expert parallelism.

[Note: MoE forward]
Tokens [S, M] (any leading shape, flattened) are routed by the gate (gating.py, [Note: routes]) into a buffer
[E, C, M] of E experts x C slots: one gather (`index_select`). With `ep_size` > 1 an all-to-all sends block j
(the experts of expert-parallel rank j) to rank j, which receives [ep, L, C, M]: the tokens of every rank of
its group for its L local experts. The experts run grouped (experts.py), a second all-to-all returns the
outputs, and one gather scaled by the route weights combines them. Both all-to-alls are autograd functions
whose backward is the opposite all-to-all. Every rank of the group sends the same-sized buffers whatever its
routing (C is agreed), so a rank that routes nothing to an expert still takes part: no hang.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from slipstream.comm import collectives
from slipstream.moe import groups
from slipstream.moe.experts import Experts
from slipstream.moe.gating import GateRules, Routes, multiplicative_jitter, route
from slipstream.utils.logging import warn_once

__all__ = ["MoE", "MOELayer", "TopKGate"]


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, group: dist.ProcessGroup | None, x: Tensor) -> Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        collectives.all_to_all(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor]:
        return None, _AllToAll.apply(ctx.group, grad)


def all_to_all(group: dist.ProcessGroup | None, x: Tensor) -> Tensor:
    out: Tensor = _AllToAll.apply(group, x)
    return out


def dispatch_with_counts(
    group: dist.ProcessGroup | None, buffer: Tensor, kept: Tensor, ep_size: int
) -> tuple[Tensor, Tensor]:
    """The dispatch all-to-all of `buffer` [E * C, M] with the sender's kept counts [E] riding along: each
    destination's block gets header rows holding the int32 counts of its experts as raw bytes (one collective,
    not two: on gloo each all-to-all is a ~1 ms synchronisation). Returns the received [ep * L * C, M] and the
    counts [ep (source), L]."""
    rows, model = buffer.shape
    local = kept.numel() // ep_size
    row_bytes = model * buffer.element_size()
    header_rows = -(-4 * local // row_bytes)
    header = torch.zeros(ep_size, header_rows * row_bytes, dtype=torch.uint8, device=buffer.device)
    header[:, : 4 * local] = kept.to(torch.int32).reshape(ep_size, local).view(torch.uint8)
    header = header.view(buffer.dtype).reshape(ep_size, header_rows, model)
    body = buffer.reshape(ep_size, rows // ep_size, model)
    received = all_to_all(group, torch.cat([body, header], dim=1).reshape(-1, model))
    received = received.reshape(ep_size, rows // ep_size + header_rows, model)
    got = received[:, rows // ep_size :].detach().contiguous().view(torch.uint8).reshape(ep_size, -1)
    counts = got[:, : 4 * local].contiguous().view(torch.int32).to(torch.long)
    return received[:, : rows // ep_size].reshape(rows, model), counts


class TopKGate(nn.Module):
    """The router: `wg` (a bias-free Linear, computed in fp32) and the gating rules of gating.py."""

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 8,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        ep_group: dist.ProcessGroup | None = None,
        top2_2nd_expert_sampling: bool = True,
    ) -> None:
        super().__init__()
        self.rules = GateRules(
            k, capacity_factor, eval_capacity_factor, min_capacity, noisy_gate_policy, drop_tokens, use_rts,
            top2_2nd_expert_sampling,
        )  # fmt: skip
        if not 1 <= k <= num_experts:
            raise ValueError(f"MoE k={k} must be between 1 and num_experts={num_experts}")
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.ep_group = ep_group
        self.ep_size = 1

    def _set_ep_group(self, ep_group: dist.ProcessGroup | None, ep_size: int = 1) -> None:
        self.ep_group, self.ep_size = ep_group, ep_size

    def routes(self, x: Tensor, used_token: Tensor | None = None) -> Routes:
        gate_input = x.float()
        if self.rules.noisy_gate_policy == "Jitter" and self.training:
            gate_input = multiplicative_jitter(gate_input)
        logits = F.linear(gate_input, self.wg.weight.float())
        return route(
            logits,
            self.rules,
            training=self.training,
            used_token=used_token,
            ep_group=self.ep_group,
            ep_size=self.ep_size,
        )

    def forward(self, x: Tensor, used_token: Tensor | None = None) -> tuple[Tensor, Routes]:
        routes = self.routes(x, used_token)
        return routes.l_aux, routes


def _rule_view(name: str) -> property:
    """`gate.<name>` reads and sets one of `gate.rules`, as DeepSpeed's gate keeps each setting as an attribute
    (`gate.k`, `gate.capacity_factor = 2.0`); a set replaces the frozen rules, checked again."""

    def read(gate: TopKGate) -> object:
        return getattr(gate.rules, name)

    def write(gate: TopKGate, value: object) -> None:
        change: dict[str, Any] = {name: value}  # GateRules checks it
        gate.rules = dataclasses.replace(gate.rules, **change)

    return property(read, write, doc=f"`rules.{name}` (DeepSpeed's attribute of the gate)")


for _field in dataclasses.fields(GateRules):
    setattr(TopKGate, _field.name, _rule_view(_field.name))


class MOELayer(nn.Module):
    """Gate, dispatch, experts, combine (see [Note: MoE forward])."""

    def __init__(
        self, gate: TopKGate, experts: Experts, ep_group_name: str, ep_size: int, num_local_experts: int
    ) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.ep_group: dist.ProcessGroup | None = None
        self.ep_size = ep_size
        self.ep_group_name = ep_group_name
        self.num_local_experts = num_local_experts
        self.l_aux: Tensor | None = None
        self.exp_counts: Tensor | None = None
        self.last_routes: Routes | None = None

    def _set_ep_group(self, ep_group: dist.ProcessGroup | None) -> None:
        self.ep_group = ep_group
        self.gate._set_ep_group(ep_group, self.ep_size)

    def forward(self, hidden: Tensor, used_token: Tensor | None = None) -> Tensor:
        model_dim = hidden.shape[-1]
        x = hidden.reshape(-1, model_dim)
        routes = self.gate.routes(x, used_token)
        self.l_aux, self.exp_counts, self.last_routes = routes.l_aux, routes.exp_counts, routes
        num_experts, cap = self.num_local_experts * self.ep_size, routes.capacity
        flat = torch.where(
            routes.experts >= 0, routes.experts * cap + routes.slots, torch.full_like(routes.slots, num_experts * cap)
        )  # [k, S]; dropped routes point at a scratch row
        source = torch.full((num_experts * cap + 1,), x.shape[0], dtype=torch.long, device=x.device)
        tokens = torch.arange(x.shape[0], device=x.device).expand_as(flat)
        source.scatter_(0, flat.reshape(-1), tokens.reshape(-1))
        padded = torch.cat([x, x.new_zeros(1, model_dim)])
        dispatched = padded.index_select(0, source[:-1])  # [E * C, M], expert-major
        local = self.num_local_experts
        # filled [ep, L]: the rows each source rank filled per local expert; None where the experts run batched
        # and compute every row anyway ([Note: filled rows only])
        looped = not self.experts.batched(x.device)
        filled = None
        if self.ep_size > 1 and looped:
            dispatched, filled = dispatch_with_counts(self.ep_group, dispatched, routes.kept, self.ep_size)
        elif self.ep_size > 1:
            dispatched = all_to_all(self.ep_group, dispatched)  # [ep (source rank), L, C, M]
        elif looped:
            filled = routes.kept.reshape(1, local)
        grouped_in = dispatched.reshape(self.ep_size, local, cap, model_dim).transpose(0, 1)
        out = self.experts(grouped_in.reshape(local, self.ep_size * cap, model_dim), filled)  # ZeRO-3 hooks run
        out_dim = out.shape[-1]
        out = out.reshape(local, self.ep_size, cap, out_dim).transpose(0, 1).reshape(num_experts * cap, out_dim)
        if self.ep_size > 1:
            out = all_to_all(self.ep_group, out)
        gathered = torch.cat([out, out.new_zeros(1, out_dim)]).index_select(0, flat.reshape(-1))
        combined = (gathered.reshape(*flat.shape, out_dim).float() * routes.weights.unsqueeze(-1)).sum(0)
        return combined.to(hidden.dtype).reshape(*hidden.shape[:-1], out_dim)


def _check_moe_arguments(num_experts: int, ep_size: int, use_tutel: bool, expert_tensor_parallelism: bool) -> None:
    """Refuse what MoE cannot build (a ValueError or NotImplementedError naming the argument); warn once that
    `use_tutel` does nothing."""
    if ep_size < 1 or num_experts % ep_size != 0:
        raise ValueError(
            f"MoE num_experts={num_experts} must be a multiple of ep_size={ep_size} (each expert-parallel "
            "rank holds num_experts / ep_size experts)"
        )
    if expert_tensor_parallelism:
        raise NotImplementedError(
            "MoE(enable_expert_tensor_parallelism=True) needs tensor parallelism, which Slipstream does not "
            "have; leave it False"
        )
    if use_tutel:
        warn_once("moe-tutel", "slipstream MoE: use_tutel=True has no effect (Tutel is not used)")


class MoE(nn.Module):
    """DeepSpeed's MoE layer. `forward(hidden_states, used_token=None)` returns (output, l_aux, exp_counts)."""

    def __init__(
        self,
        hidden_size: int,
        expert: nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        use_tutel: bool = False,
        enable_expert_tensor_parallelism: bool = False,
        top2_2nd_expert_sampling: bool = True,
    ) -> None:
        super().__init__()
        _check_moe_arguments(num_experts, ep_size, use_tutel, enable_expert_tensor_parallelism)
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = False
        self.ep_size = ep_size
        self.expert_group_name = groups.group_name(ep_size)
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        self.deepspeed_moe = MOELayer(
            TopKGate(
                hidden_size,
                num_experts,
                k,
                capacity_factor,
                eval_capacity_factor,
                min_capacity,
                noisy_gate_policy,
                drop_tokens,
                use_rts,
                None,
                top2_2nd_expert_sampling,
            ),
            Experts(expert, self.num_local_experts, self.expert_group_name),
            self.expert_group_name,
            ep_size,
            self.num_local_experts,
        )
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)
        self._z3_block = True  # ZeRO-3: one unit, its experts a unit over their own group (stage3/units.py)
        self._parallel_ready = False
        if dist.is_initialized():
            self.set_deepspeed_parallelism()

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Make (or find) the expert groups of this ep_size and hand the all-to-all group to the layer."""
        groups._create_expert_and_data_parallel(self.ep_size, use_data_before_expert_parallel_)
        self.deepspeed_moe._set_ep_group(groups._get_expert_parallel_group(self.expert_group_name))
        self._parallel_ready = True

    @property
    def ep_rank(self) -> int:
        """This rank's position in its expert-parallel group: it holds experts ep_rank * L .. ep_rank * L + L-1."""
        if not self._parallel_ready:
            return 0
        return groups._get_expert_parallel_rank(self.expert_group_name)

    def global_expert_index(self, local: int) -> int:
        return self.ep_rank * self.num_local_experts + local

    def forward(self, hidden_states: Tensor, used_token: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        if not self._parallel_ready and self.ep_size > 1:
            self.set_deepspeed_parallelism()
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            residual = self.mlp(hidden_states)
            residual = residual[0] if isinstance(residual, tuple) else residual
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + residual * coef[..., 1:]
        routes = cast(Routes, self.deepspeed_moe.last_routes)  # set by the forward above
        return output, routes.l_aux, routes.exp_counts

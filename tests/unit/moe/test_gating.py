"""The MoE layer in one process: the capacity formula and the tokens it drops, the dispatch and combine against
a per-token computation, the gate weights and load-balancing loss as DeepSpeed defines them, `used_token`,
PR-MoE's residual, grouped (vmapped) experts against a loop, and the optimizer param-group helpers."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from slipstream.moe.gating import GateRules, capacity, route
from slipstream.moe.layer import MoE
from slipstream.moe.utils import (
    is_moe_param,
    split_params_grads_into_shared_and_expert_params,
    split_params_into_different_moe_groups_for_optimizer,
)

HIDDEN, EXPERTS, TOKENS = 8, 4, 24


def expert() -> nn.Module:
    return nn.Sequential(nn.Linear(HIDDEN, 16), nn.GELU(), nn.Linear(16, HIDDEN))


def layer(**kwargs: object) -> MoE:
    torch.manual_seed(0)
    moe = MoE(HIDDEN, expert(), num_experts=EXPERTS, use_rts=False, top2_2nd_expert_sampling=False, **kwargs)
    with torch.no_grad():  # distinct experts (MoE copies the expert module) and a decisive gate
        for i, e in enumerate(moe.deepspeed_moe.experts.deepspeed_experts):
            for p in e.parameters():
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.3)
        moe.deepspeed_moe.gate.wg.weight.mul_(4)
    return moe


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("drop", [True, False])
def test_output_is_the_weighted_sum_of_each_tokens_kept_experts(k: int, drop: bool) -> None:
    moe = layer(k=k, drop_tokens=drop, capacity_factor=0.5, min_capacity=1)
    x = tokens()
    out, l_aux, counts = moe(x)
    routes = moe.deepspeed_moe.last_routes
    experts = moe.deepspeed_moe.experts.deepspeed_experts
    expected = torch.zeros_like(x)
    for s in range(TOKENS):
        for r in range(k):
            e = int(routes.experts[r, s])
            if e >= 0:
                expected[s] += routes.weights[r, s] * experts[e](x[s])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    assert int(counts.sum()) == TOKENS * k
    assert drop or int((routes.experts < 0).sum()) == 0  # dropless keeps every route
    gates = torch.softmax(moe.deepspeed_moe.gate.wg(x), dim=1)
    kept = routes.experts >= 0
    if k == 1:  # top-1 weights are the raw softmax value of the chosen expert
        chosen = gates.gather(1, routes.experts.clamp(min=0).t()).t()
        torch.testing.assert_close(routes.weights[kept], chosen[kept])
    else:  # renormalised over the kept routes of each token
        sums = routes.weights.sum(0)
        torch.testing.assert_close(sums[kept.any(0)], torch.ones(int(kept.any(0).sum())))
    me = gates.mean(0)
    first = torch.zeros(TOKENS, EXPERTS).scatter_(1, gates.argmax(1, keepdim=True), 1.0).mean(0)
    if k == 1:
        torch.testing.assert_close(l_aux, (me * first).sum() * EXPERTS)
    elif k == 2:
        torch.testing.assert_close(l_aux, (me * first).mean() * EXPERTS * EXPERTS)
    out.sum().backward()  # every piece is differentiable
    assert moe.deepspeed_moe.gate.wg.weight.grad is not None


@pytest.mark.parametrize(
    "k,factor,minimum,rts",
    [(1, 1.0, 2, False), (1, 0.5, 2, True), (2, 0.5, 1, False), (3, 0.25, 1, False), (1, 0.1, 5, False)],
)
def test_dropped_tokens_per_expert_follow_the_capacity_formula(k: int, factor: float, minimum: int, rts: bool) -> None:
    logits = torch.randn(TOKENS, EXPERTS, generator=torch.Generator().manual_seed(3)) * 3
    logits[:, 0] += 2.0  # expert 0 is popular: over capacity
    rules = GateRules(k=k, capacity_factor=factor, min_capacity=minimum, use_rts=rts, top2_2nd_expert_sampling=False)
    routes = route(logits, rules)
    cap = max(math.ceil(TOKENS / EXPERTS * factor * k), minimum)
    assert routes.capacity == cap == capacity(TOKENS, EXPERTS, factor, k, minimum)
    expected = (routes.exp_counts - cap).clamp(min=0)
    assert expected.sum() > 0
    assert routes.dropped.tolist() == expected.tolist()
    live = routes.experts >= 0
    assert int(routes.slots[live].max()) < cap
    for e in range(EXPERTS):  # every kept route of an expert has its own slot
        slots = routes.slots[routes.experts == e]
        assert slots.unique().numel() == slots.numel()
    if k == 1 and not rts:  # without random selection the first tokens of an over-full expert are kept
        first = routes.experts[0] == -1
        chosen = logits.argmax(1)
        for e in range(EXPERTS):
            mine = (chosen == e).nonzero().flatten()
            assert not first[mine[:cap]].any() and first[mine[cap:]].all()
    if k == 3:  # over capacity an expert keeps its largest gates
        gates = torch.softmax(logits, 1)
        mine = (routes.experts == 0).any(0)
        chosen0 = (torch.topk(gates, k, dim=1).indices == 0).any(1)
        kept, dropped = gates[mine & chosen0, 0], gates[~mine & chosen0, 0]
        assert kept.min() >= dropped.max()


def test_out_of_training_the_gate_uses_eval_capacity_factor_and_no_noise() -> None:
    """`eval()`: the capacity comes from eval_capacity_factor and RSample's Gumbel noise is off (each token's
    expert is its largest gate); in training the capacity comes from capacity_factor."""
    moe = layer(k=1, capacity_factor=0.25, eval_capacity_factor=1.0, min_capacity=1, noisy_gate_policy="RSample")
    gate, x = moe.deepspeed_moe.gate, tokens()
    assert gate.routes(x).capacity == capacity(TOKENS, EXPERTS, 0.25, 1, 1)
    gate.eval()
    evaluated = gate.routes(x)
    assert evaluated.capacity == capacity(TOKENS, EXPERTS, 1.0, 1, 1)
    chosen = torch.bincount(gate.wg(x).argmax(dim=1), minlength=EXPERTS)
    assert evaluated.exp_counts.tolist() == chosen.tolist()
    with pytest.raises(ValueError, match="noisy_gate_policy='Gumbel'"):
        layer(noisy_gate_policy="Gumbel")


def test_the_gate_settings_read_and_set_as_deepspeeds_attributes() -> None:
    """DeepSpeed's TopKGate keeps each setting as an attribute (`gate.k`, `gate.eval_capacity_factor`): they read
    gate.rules, and a set changes the routing (and is checked like the constructor's argument)."""
    moe = layer(k=2, capacity_factor=0.25, eval_capacity_factor=0.25, min_capacity=1)
    gate, x = moe.deepspeed_moe.gate, tokens()
    assert (gate.k, gate.capacity_factor, gate.min_capacity, gate.drop_tokens) == (2, 0.25, 1, True)
    gate.eval()
    assert gate.routes(x).capacity == capacity(TOKENS, EXPERTS, 0.25, 2, 1)
    gate.eval_capacity_factor = 1.0
    assert gate.rules.eval_capacity_factor == 1.0
    assert gate.routes(x).capacity == capacity(TOKENS, EXPERTS, 1.0, 2, 1)
    with pytest.raises(ValueError, match="noisy_gate_policy='Gumbel'"):
        gate.noisy_gate_policy = "Gumbel"
    assert gate.noisy_gate_policy is None


def test_used_token_excludes_tokens_and_residual_mixes_the_dense_mlp() -> None:
    moe = layer(k=1, drop_tokens=False, use_residual=True)
    x = tokens()
    used = torch.ones(TOKENS)
    used[:5] = 0
    out, _, counts = moe(x, used)
    assert int(counts.sum()) == TOKENS - 5
    coef = torch.softmax(moe.coefficient(x), -1)
    routes = moe.deepspeed_moe.last_routes
    experts = moe.deepspeed_moe.experts.deepspeed_experts
    moe_part = torch.stack(
        [
            routes.weights[0, s] * experts[int(routes.experts[0, s])](x[s])
            if routes.experts[0, s] >= 0
            else torch.zeros(HIDDEN)
            for s in range(TOKENS)
        ]
    )
    expected = moe_part * coef[:, :1] + moe.mlp(x) * coef[:, 1:]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    assert (routes.experts[0, :5] == -1).all()


def test_grouped_experts_match_the_loop_and_fall_back_for_unbatchable_modules() -> None:
    moe = layer(k=2, drop_tokens=False)
    experts = moe.deepspeed_moe.experts
    x = torch.randn(EXPERTS, 10, HIDDEN)
    experts.batch_experts = True  # the accelerators' path, on the CPU
    grouped = experts(x)
    assert experts._grouped is True
    loop = torch.stack([e(x[i]) for i, e in enumerate(experts.deepspeed_experts)])
    torch.testing.assert_close(grouped, loop, rtol=1e-5, atol=1e-6)

    class DataDependent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(HIDDEN, HIDDEN)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return self.lin(h) if float(h.sum()) > 0 else -self.lin(h)

    odd = MoE(HIDDEN, DataDependent(), num_experts=2).deepspeed_moe.experts
    odd.batch_experts = True
    y = odd(torch.randn(2, 3, HIDDEN))
    assert odd._grouped is False and y.shape == (2, 3, HIDDEN)


def test_param_groups_split_expert_params_by_group() -> None:
    moe = layer(k=1)
    dense = [p for p in moe.parameters() if not is_moe_param(p)]
    experts = [p for p in moe.parameters() if is_moe_param(p)]
    assert len(experts) == EXPERTS * 4 and dense and all(p.group_name == "ep_size_1" for p in experts)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(moe.parameters()), "name": "all", "lr": 0.5}, max_group_size=2 * 16 * HIDDEN
    )
    assert [len(g["params"]) for g in groups][0] == len(dense)
    moe_groups = groups[1:]
    assert all(g["moe"] and g["name"] == "ep_size_1" and g["lr"] == 0.5 for g in moe_groups)
    assert sum(len(g["params"]) for g in moe_groups) == len(experts)
    assert all(sum(p.numel() for p in g["params"]) <= 2 * 16 * HIDDEN for g in moe_groups) and len(moe_groups) > 1
    with pytest.raises(ValueError, match="multiple of ep_size"):
        MoE(HIDDEN, expert(), num_experts=3, ep_size=2)


def test_split_grads_keeps_only_params_with_grads() -> None:
    dense, expert_p, no_grad = (nn.Parameter(torch.ones(2)) for _ in range(3))
    expert_p.allreduce = False  # type: ignore[attr-defined]
    dense.grad, expert_p.grad = torch.full((2,), 2.0), torch.full((2,), 3.0)
    shared, experts = split_params_grads_into_shared_and_expert_params([dense, no_grad, expert_p])
    assert [g.tolist() for g in shared] == [[2.0, 2.0]] and [g.tolist() for g in experts] == [[3.0, 3.0]]


class _RowCounter(nn.Module):
    """An expert that records how many rows it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(HIDDEN, HIDDEN)
        self.rows: list[int] = []

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.rows.append(h.shape[0])
        return self.lin(h)


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("drop", [True, False])
@pytest.mark.parametrize("granule", [1, 4])
def test_the_cpu_path_computes_only_filled_rows_and_matches_every_row_computed(
    k: int, drop: bool, granule: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    import slipstream.moe.experts as experts_module

    monkeypatch.setattr(experts_module, "ROW_GRANULE", granule)
    torch.manual_seed(0)
    moe = MoE(
        HIDDEN,
        _RowCounter(),
        num_experts=EXPERTS,
        k=k,
        capacity_factor=1.25,
        use_rts=False,
        drop_tokens=drop,
        top2_2nd_expert_sampling=False,
    )
    x = tokens().requires_grad_()
    out, _, counts = moe(x)
    experts = moe.deepspeed_moe.experts
    routes = moe.deepspeed_moe.last_routes
    seen = [e.rows[-1] for e in experts.deepspeed_experts]
    kept = torch.bincount(routes.experts[routes.experts >= 0], minlength=EXPERTS)
    rounded = [min(-(-n // granule) * granule, routes.capacity) for n in kept.tolist()]
    assert seen == rounded  # padding beyond the rounding is not computed
    assert granule > 1 or sum(seen) < EXPERTS * routes.capacity
    for e in range(EXPERTS):  # the gate fills slots 0 .. n-1 (what the filled rows rely on)
        slots = routes.slots[routes.experts == e]
        assert sorted(slots.tolist()) == list(range(int(kept[e])))
    out.sum().backward()
    grads = [p.grad.clone() for p in moe.parameters()] + [x.grad.clone()]
    moe.zero_grad()
    x.grad = None
    experts.batch_experts = True  # every row computed (the vmapped accelerator path)
    out_all, _, _ = moe(x)
    out_all.sum().backward()
    torch.testing.assert_close(out, out_all, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, [p.grad for p in moe.parameters()] + [x.grad]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dispatch_carries_the_kept_counts_exactly_in_any_dtype(monkeypatch: pytest.MonkeyPatch, dtype) -> None:
    import slipstream.moe.layer as layer_module

    sent: list[torch.Tensor] = []

    def loopback(group: object, buffer: torch.Tensor) -> torch.Tensor:  # this rank's view: what it sent came back
        sent.append(buffer)
        return buffer.clone()

    monkeypatch.setattr(layer_module, "all_to_all", loopback)
    ep, local, cap, model = 2, 3, 5, 4  # a row of 4 bf16 values holds 2 counts: the header takes 2 rows
    buffer = torch.randn(ep * local * cap, model).to(dtype)
    kept = torch.tensor([5, 0, 70_001, 3, 1, 2**24 + 1])  # beyond bf16's and fp32's exact integers
    received, counts = layer_module.dispatch_with_counts(None, buffer, kept, ep)
    assert counts.tolist() == [[5, 0, 70_001], [3, 1, 2**24 + 1]]
    assert torch.equal(received, buffer) and sent[0].shape[0] > buffer.shape[0]

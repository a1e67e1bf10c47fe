"""slipstream.moe.gating.route against gating_reference.py, a token-by-token reading of DeepSpeed's gating rules:
for k = 1, 2, 3, several seeds and shapes, with and without capacity drops, every route's expert, slot and
combine weight, the capacity, the counts and the load-balancing loss."""

from __future__ import annotations

import math

import pytest
import torch

from slipstream.moe import gating
from tests.unit.moe import gating_reference as reference

SHAPES = [(8, 2), (24, 4), (50, 5), (67, 8)]  # (tokens, experts)
SEEDS = [0, 1, 2]
FACTORS = [(0.5, 1), (1.25, 4)]  # (capacity_factor, min_capacity)


def make_logits(num_tokens: int, num_experts: int, seed: int) -> torch.Tensor:
    """Random logits; odd seeds favour expert 0, so its buffer overflows."""
    logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(seed)) * 2
    if seed % 2:
        logits[:, 0] += 1.5
    return logits


def assert_same_decision(routes: gating.Routes, expected: reference.Decision, where: str) -> int:
    """Every route of `routes` equals the reference's; the number of dropped routes."""
    assert routes.capacity == expected.capacity, f"{where}: capacity {routes.capacity} != {expected.capacity}"
    assert routes.exp_counts.tolist() == expected.exp_counts, f"{where}: exp_counts"
    assert math.isclose(float(routes.l_aux), expected.l_aux, rel_tol=1e-5), (
        f"{where}: l_aux {float(routes.l_aux)} != reference {expected.l_aux}"
    )
    dropped = 0
    for s, row in enumerate(expected.routes):
        for r, want in enumerate(row):
            got = (int(routes.experts[r, s]), int(routes.slots[r, s]), float(routes.weights[r, s]))
            if want is None:
                dropped += 1
                assert got[0] == -1 and got[2] == 0.0, f"{where}: token {s} route {r} should drop, got {got}"
                continue
            assert got[:2] == want[:2], f"{where}: token {s} route {r} (expert, slot) {got[:2]} != {want[:2]}"
            assert math.isclose(got[2], want[2], rel_tol=1e-5), f"{where}: token {s} route {r} weight"
    return dropped


@pytest.mark.parametrize("k", [1, 2, 3])
def test_routes_slots_weights_and_l_aux_match_the_reference(k: int) -> None:
    dropped_somewhere = False
    for (num_tokens, num_experts), seed, (factor, minimum), drop in (
        (shape, seed, factors, drop) for shape in SHAPES for seed in SEEDS for factors in FACTORS for drop in (1, 0)
    ):
        if k > num_experts:
            continue
        logits = make_logits(num_tokens, num_experts, seed)
        rules = gating.GateRules(
            k=k,
            capacity_factor=factor,
            min_capacity=minimum,
            drop_tokens=bool(drop),
            use_rts=False,
            top2_2nd_expert_sampling=False,
        )
        routes = gating.route(logits, rules)
        expected = reference.gate(
            logits.tolist(), k=k, capacity_factor=factor, min_capacity=minimum, drop_tokens=bool(drop)
        )
        where = f"k={k} S={num_tokens} E={num_experts} seed={seed} factor={factor} min={minimum} drop={drop}"
        dropped = assert_same_decision(routes, expected, where)
        assert drop or dropped == 0, f"{where}: dropless gating dropped {dropped} routes"
        dropped_somewhere |= dropped > 0
    assert dropped_somewhere, "the grid must include cases where capacity drops routes"


@pytest.mark.parametrize("seed", [0, 1, 5])
def test_random_token_selection_keeps_the_tokens_with_the_largest_draws(seed: int) -> None:
    """Top-1 with `use_rts`: an over-full expert keeps the tokens whose uniform draws are largest, one [S, E]
    draw after seeding, as DeepSpeed draws it."""
    logits = make_logits(40, 4, 1)
    torch.manual_seed(seed)
    routes = gating.route(logits, gating.GateRules(k=1, capacity_factor=0.5, min_capacity=1, use_rts=True))
    torch.manual_seed(seed)
    uniform = torch.rand(40, 4).tolist()
    expected = reference.gate(logits.tolist(), k=1, capacity_factor=0.5, min_capacity=1, uniform=uniform)
    assert assert_same_decision(routes, expected, f"rts seed={seed}") > 0


@pytest.mark.parametrize("drop", [True, False])
def test_unused_tokens_route_nowhere_and_count_nowhere(drop: bool) -> None:
    logits = make_logits(24, 4, 3)
    used = [float(s % 3 != 0) for s in range(24)]
    routes = gating.route(
        logits,
        gating.GateRules(k=1, capacity_factor=0.5, min_capacity=1, drop_tokens=drop, use_rts=False),
        used_token=torch.tensor(used),
    )
    expected = reference.gate(
        logits.tolist(), k=1, capacity_factor=0.5, min_capacity=1, drop_tokens=drop, used_token=used
    )
    assert_same_decision(routes, expected, f"used_token drop={drop}")


def test_capacity_is_deepspeeds_float32_product() -> None:
    """ceil(S / E * capacity_factor * k) as DeepSpeed computes it, in float32: 25 tokens on 2 experts at factor
    1.2 give 16 slots (15.0000006 in float32), where double arithmetic gives exactly 15."""
    assert gating.capacity(25, 2, 1.2, 1, 1) == 16
    mismatches = [
        (s, e, f, k)
        for s in range(1, 80)
        for e in (2, 3, 4, 6, 7, 8)
        for f in (0.1, 0.2, 0.3, 0.5, 1.0, 1.1, 1.2, 1.25, 2.0)
        for k in (1, 2, 3)
        if gating.capacity(s, e, f, k, 1) != reference.capacity(s, e, f, k, 1)
    ]
    assert not mismatches, f"(tokens, experts, capacity_factor, k) with another capacity: {mismatches[:10]}"
    assert gating.capacity(4, 8, 1.0, 1, 4) == reference.capacity(4, 8, 1.0, 1, 4) == 4  # min_capacity wins

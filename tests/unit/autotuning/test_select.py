"""Pruning and ranking (autotuning/select.py) against what the engine really allocates.

The planner-vs-real relation: for each candidate of a tiny grid, the engine is built with the candidate's config
and trained two steps; what it owns (`engine.optimizer.owned_bytes()`, the figure the planner is validated
against in tests/dist/planner) is the memory the candidate really needs. With that as the budget the candidate
fits by definition, and the pruner must keep it; with a budget well under it the pruner must skip it.
"""

from __future__ import annotations

import dataclasses

import pytest

import slipstream
from slipstream.autotuning.estimates import Figures, estimate_config
from slipstream.autotuning.select import DEFAULT_MARGIN, needed_bytes, rank
from slipstream.autotuning.space import Candidate, candidate_config, grid
from slipstream.config import resolve
from tests.harness.models import TinyMLP

USER = {
    "train_batch_size": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"reduce_bucket_size": 300, "stage3_param_persistence_threshold": 40},
}
TUNING = {"min_train_micro_batch_size_per_gpu": 2, "max_train_micro_batch_size_per_gpu": 4}


def _plan():  # type: ignore[no-untyped-def]
    return resolve({**USER, "autotuning": TUNING}, world_size=1).autotuning


def _real_and_figures(candidate: Candidate) -> tuple[int, Figures]:
    """(bytes the engine owns after two steps, the planner's figures) for one candidate at world size 1."""
    config = candidate_config(USER, candidate, world=1)
    model = TinyMLP()
    engine, *_ = slipstream.initialize(model=model, config=config)
    device, host = estimate_config(config, module=engine.module, world_size=1, gpus_per_node=1)
    for seed in range(2):
        inputs, targets = model.make_batch(seed=seed, batch_size=candidate.micro_batch)
        engine.backward(TinyMLP.loss(engine(inputs), targets))
        engine.step()
    real = sum(engine.optimizer.owned_bytes().values())
    engine.destroy()
    return real, Figures(device=device, host=host, activations=None)


@pytest.fixture(scope="module")
def measured() -> list[tuple[Candidate, int, Figures]]:
    candidates = [c for c in grid(_plan(), USER, world=1) if c.micro_batch == 2]
    assert {(c.stage, c.offload_optimizer) for c in candidates if not c.offload_param} == {
        (0, False),
        (1, False),
        (1, True),
        (2, False),
        (2, True),
        (3, False),
        (3, True),
    }
    assert sorted(c.name for c in candidates if c.offload_param) == [
        "z3_offload_params_mbs2_gas2",
        "z3_params_mbs2_gas2",
    ]
    return [(c, *_real_and_figures(c)) for c in candidates]


def _verdict(candidate: Candidate, figures: Figures, budget: int) -> str:
    (ranked,) = rank(
        [candidate],
        {candidate.name: figures},
        budget=budget,
        host_budget=None,
        ranks_per_node=1,
        num_micro_batches=3,
        device_is_host=True,
    )
    return ranked.skipped


def test_pruning_never_skips_a_candidate_that_fits(measured: list[tuple[Candidate, int, Figures]]) -> None:
    for candidate, real, figures in measured:
        predicted = needed_bytes(figures, device_is_host=True)
        if candidate.offload_param:
            # on the CPU the engine owns the parameters twice with offload_param (its "params" shard and the
            # offloaded copy) where the planner counts the offloaded copy only: an under-count, never a wrong skip
            assert predicted <= real * (1 + DEFAULT_MARGIN), (candidate.name, predicted, real)
        else:
            assert abs(predicted - real) <= DEFAULT_MARGIN * real, (candidate.name, predicted, real)
        assert _verdict(candidate, figures, budget=real) == "", f"{candidate.name} fits in {real} B but was skipped"


def test_pruning_skips_what_cannot_fit(measured: list[tuple[Candidate, int, Figures]]) -> None:
    for candidate, real, figures in measured:
        assert "over the budget" in _verdict(candidate, figures, budget=int(real * 0.7)), candidate.name


def _figures(device: int) -> Figures:
    return Figures(device=device, host=0, activations=None)


def test_ranking_puts_fitting_candidates_first_and_keeps_the_largest_micro_batches() -> None:
    make = lambda stage, micro: Candidate(  # noqa: E731
        stage=stage, offload_optimizer=False, micro_batch=micro, grad_accum=1, reduce_bucket_size=None
    )
    small, large, huge, z3 = make(0, 2), make(0, 4), make(0, 8), make(3, 2)
    figures = {
        small.name: _figures(100),
        large.name: _figures(200),
        huge.name: _figures(105_000),
        z3.name: _figures(50),
    }
    ranked = rank(
        [small, large, huge, z3],
        figures,
        budget=1000,
        host_budget=None,
        ranks_per_node=1,
        num_micro_batches=1,
        device_is_host=False,
    )
    names = [(r.candidate.name, r.skipped.split(",")[0]) for r in ranked]
    assert names[0] == (large.name, "")  # the largest micro batch of stage 0 that fits; the best estimate
    assert names[1] == (z3.name, "")
    assert {n for n, why in names[2:] if why} == {small.name, huge.name}
    assert "beyond the 1 largest" in next(r.skipped for r in ranked if r.candidate == small)
    within = rank(
        [dataclasses.replace(large)],
        {large.name: _figures(1050)},
        budget=1000,
        host_budget=None,
        ranks_per_node=1,
        num_micro_batches=1,
        device_is_host=False,
    )
    assert within[0].skipped == "" and not within[0].within_budget  # kept by the margin, ranked after the rest


def test_the_host_budget_is_per_node_off_the_cpu() -> None:
    candidate = Candidate(stage=2, offload_optimizer=True, micro_batch=2, grad_accum=1, reduce_bucket_size=None)
    figures = {candidate.name: Figures(device=10, host=600, activations=40)}
    (ranked,) = rank(
        [candidate], figures, budget=100, host_budget=1000, ranks_per_node=2, num_micro_batches=1, device_is_host=False
    )
    assert ranked.needed == 50 and "host memory per node" in ranked.skipped

"""`autotuning.tuner_type` (autotuning/order.py): gridsearch follows the ranking, random is a seeded shuffle of
the kept candidates, model_based refits its model after every trial and lets it pick the next one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slipstream.autotuning.order import fit, make_order
from slipstream.autotuning.select import Ranked, estimated_throughput
from slipstream.autotuning.space import Candidate
from slipstream.autotuning.tuner import tune
from tests.unit.autotuning.test_tuner import _job


def _kept() -> list[Ranked]:
    items = [
        Candidate(stage=s, offload_optimizer=o, micro_batch=m, grad_accum=1, reduce_bucket_size=None)
        for s in (0, 1, 2, 3)
        for o in ((False, True) if s else (False,))
        for m in (2, 4)
    ]
    ranked = [
        Ranked(candidate=c, needed=1, estimate=estimated_throughput(c), skipped="", within_budget=True) for c in items
    ]
    return sorted(ranked, key=lambda r: -r.estimate)


def _drain(tuner_type: str, seed: int = 0) -> list[str]:
    order = make_order(tuner_type, _kept(), seed=seed)
    names = []
    while (item := order.next()) is not None:
        names.append(item.candidate.name)
    return names


def test_random_is_a_seeded_shuffle_of_the_kept_candidates() -> None:
    ranked = [r.candidate.name for r in _kept()]
    assert _drain("gridsearch") == ranked
    first, again, other = _drain("random", seed=0), _drain("random", seed=0), _drain("random", seed=1)
    assert sorted(first) == sorted(ranked)  # every kept candidate, each once
    assert first == again  # the same seed, the same order
    assert first != other and first != ranked
    with pytest.raises(ValueError, match="tuner_type='annealing' is not one of gridsearch, random, model_based"):
        make_order("annealing", [], seed=0)


def test_the_fit_recovers_a_linear_correction() -> None:
    samples = [([1.0, s / 3, 0.0, 0.0, 1.0], 0.5 + 1.2 * s / 3) for s in range(4)]
    weights = fit(samples)
    assert weights[0] + weights[4] == pytest.approx(0.5, abs=0.05) and weights[1] == pytest.approx(1.2, abs=0.05)


def _trials(tmp_path: Path, tuner_type: str, *, seed: int = 0) -> list[str]:
    job = _job(
        tmp_path / f"{tuner_type}{seed}", budget=10**9, trials=3, num_tuning_micro_batch_sizes=1, tuner_type=tuner_type
    )
    job = type(job)(**{**{f: getattr(job, f) for f in job.__dataclass_fields__}, "seed": seed})
    return [t.ranked.candidate.name for t in tune(job).trials]


def test_model_based_follows_the_measurements(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the ranking puts ZeRO 0 first and ZeRO 3 last; the measurements double with every stage
    monkeypatch.setenv("FAKE_TRIALS", json.dumps({"0": 1.0, "1": 2.0, "2": 4.0, "3": 8.0}))
    assert _trials(tmp_path, "gridsearch") == ["z0_mbs8_gas1", "z1_mbs8_gas1", "z2_mbs8_gas1"]
    # two trials show the trend; the refitted model skips ZeRO 2 for the stage it predicts fastest
    assert _trials(tmp_path, "model_based") == ["z0_mbs8_gas1", "z1_mbs8_gas1", "z3_mbs8_gas1"]
    shuffled = _trials(tmp_path, "random", seed=0)
    assert shuffled != _trials(tmp_path, "random", seed=1) and len(set(shuffled)) == 3

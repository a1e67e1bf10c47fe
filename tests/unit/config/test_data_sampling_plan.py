"""data_efficiency.data_sampling resolves into the curriculum sampler's plan: the keys it honours, the switches
above it, what it refuses by name and what it reports."""

from __future__ import annotations

import copy

import pytest

from slipstream.config.errors import ConfigError
from slipstream.config.resolve import resolve

METRIC = {"index_to_sample_path": "idx/seqlen_index_to_sample", "index_to_metric_path": "idx/seqlen_index_to_metric",
          "difficulty_type": "value", "clustering_type": "schedule_based", "min_difficulty": 8, "max_difficulty": 64,
          "schedule_type": "fixed_root",
          "schedule_config": {"total_curriculum_step": 100, "difficulty_step": 8, "root_degree": 2}}
CONFIG = {"train_batch_size": 8, "data_efficiency": {"enabled": True, "seed": 7, "data_sampling": {
    "enabled": True, "num_epochs": 3, "num_workers": 2, "curriculum_learning": {
        "enabled": True, "data_cluster_path": "clusters", "curriculum_metrics": {"seqlen": METRIC}}}}}
WHERE = "data_efficiency.data_sampling.curriculum_learning"


def _with(path: tuple[str, ...], value: object) -> dict:
    config = copy.deepcopy(CONFIG)
    section = config
    for key in path[:-1]:
        section = section[key]
    section[path[-1]] = value
    return config


def test_the_section_becomes_the_sampler_plan() -> None:
    plan = resolve(CONFIG, world_size=1)
    sampling = plan.schedules.sampling
    assert sampling is not None and (sampling.seed, sampling.num_epochs, sampling.num_workers) == (7, 3, 2)
    (metric,) = sampling.metrics
    assert (metric.name, metric.index_to_sample_path, metric.difficulty_type) == (
        "seqlen", "idx/seqlen_index_to_sample", "value")
    assert (metric.schedule.schedule_type, metric.schedule.root_degree, metric.schedule.max_difficulty) == (
        "fixed_root", 2, 64)
    assert plan.unimplemented == (f"{WHERE}.data_cluster_path",)  # the clusters stay in memory


@pytest.mark.parametrize("switch", [("data_efficiency", "enabled"), ("data_efficiency", "data_sampling", "enabled")])
def test_a_switch_above_the_curriculum_turns_the_sampler_off_and_says_so(switch: tuple[str, ...]) -> None:
    plan = resolve(_with(switch, False), world_size=1)
    assert plan.schedules.sampling is None
    assert any(key.startswith(f"{WHERE}.enabled (ignored: {'.'.join(switch)} is false") for key in plan.unimplemented)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"index_to_metric_path": None}, "index_to_metric_path not set"),
        ({"clustering_type": "by_value"}, "curriculum_metrics.seqlen.clustering_type"),
        ({"bogus": 1}, "curriculum_metrics.seqlen.bogus"),
        ({"difficulty_type": "rank"}, "curriculum_metrics.seqlen.difficulty_type"),
        ({"schedule_config": {"total_curriculum_step": 100}}, "schedule_config.difficulty_step"),
    ],
)
def test_a_broken_metric_is_refused_by_name(change: dict, named: str) -> None:
    metric = {key: value for key, value in {**METRIC, **change}.items() if value is not None}
    config = _with(("data_efficiency", "data_sampling", "curriculum_learning", "curriculum_metrics"), {"seqlen": metric})
    with pytest.raises(ConfigError, match=named.replace(".", r"\.").replace("\"", "\"")):
        resolve(config, world_size=1)


def test_a_custom_schedule_needs_only_its_limits() -> None:
    metric = {key: value for key, value in METRIC.items() if key != "schedule_config"}
    config = _with(("data_efficiency", "data_sampling", "curriculum_learning", "curriculum_metrics"),
                   {"seqlen": {**metric, "schedule_type": "custom"}})
    sampling = resolve(config, world_size=1).schedules.sampling
    assert sampling is not None and sampling.metrics[0].schedule.schedule_type == "custom"


def test_a_single_cluster_metric_needs_no_index_and_unknown_schedule_keys_are_reported() -> None:
    metric = {**METRIC, "clustering_type": "single_cluster", "index_to_sample_path": None,
              "index_to_metric_path": None, "schedule_config": {**METRIC["schedule_config"], "warmup": 5}}
    metric = {key: value for key, value in metric.items() if value is not None}
    config = _with(("data_efficiency", "data_sampling", "curriculum_learning", "curriculum_metrics"), {"seqlen": metric})
    plan = resolve(config, world_size=1)
    assert plan.schedules.sampling is not None and plan.schedules.sampling.metrics[0].index_to_sample_path is None
    assert f"{WHERE}.curriculum_metrics.seqlen.schedule_config.warmup" in plan.unimplemented

"""The curriculum sampler against a hand-built metric index of 20 samples: which samples each difficulty
makes eligible (worked out by hand below), value vs percentile difficulty, the split of a global batch over
two data-parallel ranks, a checkpoint round trip that continues the same batches, and the effect of
num_epochs, seed and num_workers."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from slipstream.config.data_plans import CurriculumPlan, DataSamplingPlan, MetricPlan
from slipstream.data.curriculum_sampler import CurriculumSampler
from slipstream.data.indexed_dataset import write_rows
from slipstream.data.sampled_loader import CurriculumDataLoader

# sample i has metric METRIC[i]
METRIC = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]
# by hand: value -> samples, in sample order
ROWS = {1: [1, 3], 2: [6, 16], 3: [0, 9, 15, 17], 4: [2, 19], 5: [4, 8, 10], 6: [7], 7: [13], 8: [11, 18],
        9: [5, 12, 14]}
AT_MOST_2 = {1, 3, 6, 16}
AT_MOST_4 = AT_MOST_2 | {0, 9, 15, 17, 2, 19}
FIRST_30_PERCENT = {1, 3, 6, 16, 0, 9}  # 6 of 20 samples: the rows laid end to end, cut inside the value-3 row


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("index")
    write_rows(str(folder / "m_index_to_sample"), list(ROWS.values()), "uint8")
    write_rows(str(folder / "m_index_to_metric"), [[value] for value in ROWS], "uint8")
    return folder


def _plan(index: Path, kind: str, difficulties: tuple[int, ...], max_steps: tuple[int, ...]) -> DataSamplingPlan:
    schedule = CurriculumPlan(min_difficulty=difficulties[0], max_difficulty=difficulties[-1],
                              schedule_type="fixed_discrete", total_step=0, difficulty_step=1, root_degree=1,
                              difficulties=difficulties, max_steps=max_steps)
    metric = MetricPlan(name="m", index_to_sample_path=str(index / "m_index_to_sample"),
                        index_to_metric_path=str(index / "m_index_to_metric"), difficulty_type=kind,
                        schedule=schedule)
    return DataSamplingPlan(seed=1234, num_epochs=100, num_workers=0, metrics=(metric,))


def _sampler(plan: DataSamplingPlan, *, micro: int = 4, rank: int = 0, world: int = 1) -> CurriculumSampler:
    return CurriculumSampler(plan, num_samples=20, micro_batch_size=micro, rank=rank, world_size=world,
                             gradient_accumulation_steps=1)


def test_value_difficulty_draws_only_eligible_samples(index: Path) -> None:
    sampler = _sampler(_plan(index, "value", (2, 4, 9), (2, 4)))
    batches = [sampler.next_global_batch() for _ in range(8)]
    # steps 1-2: exactly the 4 samples of value <= 2, each once per step (one cluster of 4, read in turn)
    assert [set(batch) for batch in batches[:2]] == [AT_MOST_2, AT_MOST_2]
    assert all(set(batch) <= AT_MOST_4 for batch in batches[2:4])
    assert any(set(batch) - AT_MOST_2 for batch in batches[2:4])  # the new cluster is drawn from
    assert set().union(*batches[4:]) - AT_MOST_4  # from step 5 on every value is eligible
    assert sampler.current_difficulties == {"m": 9}


def test_percentile_difficulty_cuts_inside_a_row(index: Path) -> None:
    sampler = _sampler(_plan(index, "percentile", (3, 10), (3,)))
    drawn = [set(sampler.next_global_batch()) for _ in range(3)]
    assert set().union(*drawn) == FIRST_30_PERCENT  # 12 draws from 6 samples cover them all
    value = _sampler(_plan(index, "value", (3, 10), (3,)))
    assert set().union(*(value.next_global_batch() for _ in range(3))) <= AT_MOST_2 | set(ROWS[3])


def test_two_ranks_partition_the_global_batch(index: Path) -> None:
    plan = _plan(index, "value", (2, 4, 9), (2, 4))
    whole = iter(_sampler(plan, micro=4))
    ranks = [iter(_sampler(plan, micro=2, rank=rank, world=2)) for rank in (0, 1)]
    for _ in range(6):
        expected = next(whole)
        assert len(expected) == 4
        assert next(ranks[0]) + next(ranks[1]) == expected


def test_checkpoint_round_trip_continues_the_same_batches(index: Path) -> None:
    plan = _plan(index, "value", (2, 4, 9), (2, 4))
    first = _sampler(plan, micro=2)
    stream = iter(first)
    for _ in range(7):  # steps 1-4 (two micro-batches each): the value <= 2 cluster was reshuffled meanwhile
        next(stream)
    state = json.loads(json.dumps(first.state_dict()))  # a checkpoint holds it as JSON
    assert len(state["clusters"][0]["shuffles"]) > 1
    after = [next(stream) for _ in range(12)]
    resumed = _sampler(plan, micro=2)
    resumed.load_state_dict(state)
    assert [batch for batch, _ in zip(resumed, range(12))] == after


def test_num_epochs_seed_and_num_workers_take_effect(index: Path) -> None:
    plan = _plan(index, "value", (2, 4, 9), (2, 4))
    for epochs, batches in ((1, 6), (2, 11)):  # it stops once more than epochs * 20 samples went out (DeepSpeed's)
        sampler = _sampler(dataclasses.replace(plan, num_epochs=epochs))
        assert sum(1 for _ in sampler) == batches
    draws = {seed: _sampler(dataclasses.replace(plan, seed=seed)).next_global_batch() for seed in (1234, 99)}
    assert draws[1234] != draws[99] and set(draws[1234]) == set(draws[99]) == AT_MOST_2
    loader = CurriculumDataLoader(list(range(20)), dataclasses.replace(plan, num_workers=2), micro_batch_size=2,
                                  rank_and_size=(0, 1), gradient_accumulation_steps=1, drop_last=False)
    assert loader.num_workers == 2 and len(loader) == 20 * 100 // 2


def test_custom_schedule_takes_the_function_given(index: Path) -> None:
    plan = _plan(index, "value", (2, 9), (1,))
    custom = dataclasses.replace(plan.metrics[0].schedule, schedule_type="custom", difficulties=(), max_steps=())
    sampler = _sampler(dataclasses.replace(plan, metrics=(dataclasses.replace(plan.metrics[0], schedule=custom),)))
    with pytest.raises(RuntimeError, match="set_custom_curriculum_learning_schedule"):
        sampler.next_global_batch()
    sampler.set_custom_curriculum_learning_schedule({"m": lambda step: 2 if step <= 3 else 4, "other": len})
    assert [set(sampler.next_global_batch()) for _ in range(3)] == [AT_MOST_2] * 3  # 3 steps at difficulty 2
    later = set().union(*(sampler.next_global_batch() for _ in range(6)))
    assert later <= AT_MOST_4 and later - AT_MOST_2 and sampler.current_difficulties == {"m": 4}


def test_custom_schedule_resumes_at_its_difficulty(index: Path) -> None:
    plan = _plan(index, "value", (2, 9), (1,))
    custom = dataclasses.replace(plan.metrics[0].schedule, schedule_type="custom", difficulties=(), max_steps=())
    plan = dataclasses.replace(plan, metrics=(dataclasses.replace(plan.metrics[0], schedule=custom),))
    first = _sampler(plan, micro=2)
    first.set_custom_curriculum_learning_schedule({"m": lambda step: 9 if step >= 3 else 2})
    stream = iter(first)
    assert [set(next(stream)) <= AT_MOST_2 for _ in range(3)][:2] == [True, True]  # steps 1-2 at difficulty 2
    state = json.loads(json.dumps(first.state_dict()))  # after step 3: difficulty 9, the maximum
    after = [next(stream) for _ in range(6)]
    resumed = _sampler(plan, micro=2)
    resumed.load_state_dict(state)
    resumed.set_custom_curriculum_learning_schedule({"m": lambda step: 2})  # ignored: the maximum was reached
    assert [batch for batch, _ in zip(resumed, range(6))] == after and resumed.current_difficulties == {"m": 9}

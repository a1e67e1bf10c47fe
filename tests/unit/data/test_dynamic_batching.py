"""Dynamic batching against a hand-built list of 20 sequence lengths: the token groups of each picking order and
limit (worked out by hand below), the split of the groups over ranks and micro-batches, the learning rate of
each step against the scaling formula, and the resumption of the batch sampler and the LR schedule."""

from __future__ import annotations

import dataclasses
import logging
import math
import random
from pathlib import Path

import pytest
import torch

import slipstream
from slipstream.compat.variable_batch_size_and_lr import batch_by_seqlens
from slipstream.compat.variable_batch_size_and_lr import (
    get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed as variable_batches,
)
from slipstream.config import ConfigError, resolve
from slipstream.data.dynamic_batching import group_by_tokens, rank_micro_batches, scale_lr
from slipstream.data.indexed_dataset import write_rows
from slipstream.data.variable_batch import (
    VariableBatchSampler,
    VariableBatchSizeLR,
    seqlens_from_metrics,
    variable_batch_loader,
)

LENGTHS = [5, 3, 8, 2, 7, 4, 6, 1, 9, 3, 2, 5, 4, 8, 1, 6, 3, 7, 2, 4]
# By hand, max_tokens 10, dataset order: each group takes the next samples while the total stays <= 10:
# 5+3 | 8+2 | 7 | 4+6 | 1+9 | 3+2+5 | 4 | 8+1 | 6+3 | 7+2 | 4
GROUPS = [[0, 1], [2, 3], [4], [5, 6], [7, 8], [9, 10, 11], [12], [13, 14], [15, 16], [17, 18], [19]]
# By length (then index): 1 1 2 2 2 | 3 3 3 | 4 4 | 4 5 | 5 | 6 | 6 | 7 | 7 | 8 | 8 | 9
BY_LENGTH = [[7, 14, 3, 10, 18], [1, 9, 16], [5, 12], [19, 0], [11], [6], [15], [4], [17], [2], [13], [8]]


def test_groups_follow_the_token_rule() -> None:
    packing = group_by_tokens(LENGTHS, max_tokens=10, groups_per_batch=1)
    assert packing.groups == GROUPS and packing.left_out == []
    assert all(sum(LENGTHS[s] for s in group) <= 10 for group in packing.groups)
    assert group_by_tokens(LENGTHS, max_tokens=10, groups_per_batch=1, order="seqlen").groups == BY_LENGTH
    # four groups a global batch: two whole batches, the last three groups left out
    packing = group_by_tokens(LENGTHS, max_tokens=10, groups_per_batch=4)
    assert packing.groups == GROUPS[:8] and packing.left_out == [15, 16, 17, 18, 19]
    assert packing.batch_sizes == [7, 8] and packing.batch_max_seqlens == [8, 9]
    ids = [(i // 4, group) for i, group in enumerate(GROUPS[:8])]  # DeepSpeed's return: (batch id, group)
    assert batch_by_seqlens(LENGTHS, 10, effective_batch_size=4) == (ids, [7, 8], [8, 9])
    capped = group_by_tokens(LENGTHS, max_tokens=10, groups_per_batch=1, max_batch_size=2).groups
    assert capped[5:7] == [[9, 10], [11, 12]]  # 3+2 stops at two samples, then 5+4
    # min_batch_size 2: the third group can only hold sample 4 (7 + 4 > 10), so the packing ends there
    short = group_by_tokens(LENGTHS, max_tokens=10, groups_per_batch=1, min_batch_size=2)
    assert short.groups == [[0, 1], [2, 3]] and short.left_out == list(range(4, 20))
    longer = group_by_tokens(LENGTHS, max_tokens=8, groups_per_batch=1, samples=[8, 0, 1, 2])
    assert longer.groups == [[0, 1], [2]] and longer.left_out == [8]  # 9 tokens alone exceed max_tokens
    shuffled = list(range(20))
    random.Random(7).shuffle(shuffled)
    mixed = group_by_tokens(LENGTHS, max_tokens=10, groups_per_batch=1, order="random", seed=7).groups
    assert sum(mixed, []) == shuffled and mixed != GROUPS
    with pytest.raises(ValueError, match="fewer than one global batch"):
        group_by_tokens(LENGTHS, max_tokens=10, groups_per_batch=12)
    with pytest.raises(ValueError, match="sequence_picking_order"):
        group_by_tokens(LENGTHS, max_tokens=10, groups_per_batch=1, order="length")


def test_ranks_read_interleaved_groups() -> None:
    groups = GROUPS[:8]  # micro-batch 2, two ranks: rank r reads groups r, r + 2, ...; two of them a micro-batch
    assert list(rank_micro_batches(groups, micro_batch_size=2, rank=0, world_size=2)) == [[0, 1, 4], [7, 8, 12]]
    assert list(rank_micro_batches(groups, micro_batch_size=2, rank=1, world_size=2)) == [
        [2, 3, 5, 6],
        [9, 10, 11, 13, 14],
    ]


def test_learning_rate_per_step_follows_the_formula() -> None:
    assert scale_lr(4, 7, 0.1, "linear") == pytest.approx(0.175)
    assert scale_lr(4, 9, 0.1, "sqrt") == pytest.approx(0.15)
    assert scale_lr(4, 9, 0.1, "none") == 0.1
    with pytest.raises(ValueError, match="lr_scaling_method"):
        scale_lr(4, 9, 0.1, "cubic")
    sizes = group_by_tokens(LENGTHS, max_tokens=10, groups_per_batch=4).batch_sizes  # [7, 8]
    for method, factor in (("linear", lambda n: n / 4), ("sqrt", lambda n: math.sqrt(n / 4)), ("none", lambda n: 1)):
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
        halving = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        schedule = VariableBatchSizeLR(
            optimizer, base_schedule=halving, base_batch_size=4, batch_sizes=sizes, method=method
        )
        seen = [schedule.get_lr()[0]]
        for _ in range(3):
            optimizer.step()
            schedule.step()
            seen.append(optimizer.param_groups[0]["lr"])
        # step i: the base rate 0.1 * 0.5**i, scaled for batch i % 2 of sizes 7, 8
        expected = [0.1 * 0.5**i * factor(sizes[i % 2]) for i in range(4)]
        assert seen == pytest.approx(expected), method


def test_sampler_and_schedule_resume() -> None:
    packing = group_by_tokens(LENGTHS, max_tokens=10, groups_per_batch=2)  # 10 groups: five global batches
    sampler = VariableBatchSampler(packing, micro_batch_size=1, rank=1, world_size=2)
    stream = iter(sampler)
    head = [next(stream) for _ in range(2)]
    assert head == [[2, 3], [5, 6]]  # rank 1 reads groups 1 and 3 first
    state = dict(sampler.state_dict())
    rest = list(stream)
    resumed = VariableBatchSampler(packing, micro_batch_size=1, rank=1, world_size=2)
    resumed.load_state_dict(state)
    assert list(resumed) == rest == [[9, 10, 11], [13, 14], [17, 18]]
    assert len(list(resumed)) == len(resumed) == 5  # the next pass starts from the first batch again
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    schedule = VariableBatchSizeLR(
        optimizer, base_schedule=None, base_batch_size=2, batch_sizes=packing.batch_sizes, method="linear"
    )
    schedule.step()
    saved = schedule.state_dict()
    schedule.step()
    other = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    again = VariableBatchSizeLR(
        other, base_schedule=None, base_batch_size=2, batch_sizes=packing.batch_sizes, method="linear"
    )
    again.load_state_dict(saved)
    again.step()
    assert again.get_lr() == pytest.approx(schedule.get_lr()) == [0.1 * packing.batch_sizes[2] / 2]


class _Sum(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(1))

    def forward(self, samples: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(samples).mean() * self.weight


def _engine_and_loader(config: dict) -> tuple:
    engine, *_ = slipstream.initialize(model=_Sum(), config=config)
    dataset = [torch.full((length,), float(index)) for index, length in enumerate(LENGTHS)]
    loader, schedule, _ = variable_batches(dataset, engine, dataset_seqlens=LENGTHS, dataloader_collate_fn=list)
    return engine, loader, schedule


def _train(engine: object, stream: object, steps: int) -> list[tuple[list[int], float]]:
    seen = []
    for _ in range(steps):
        samples = next(stream)  # type: ignore[call-overload]
        seen.append(([int(sample[0]) for sample in samples], engine.get_lr()[0]))  # type: ignore[attr-defined]
        engine.backward(engine(samples))  # type: ignore[attr-defined, operator]
        engine.step()  # type: ignore[attr-defined]
    return seen


def test_the_engine_trains_on_variable_batches_and_resumes(tmp_path: Path) -> None:
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "data_efficiency": {"data_sampling": {"dynamic_batching": {"enabled": True, "max_tokens": 10}}}}
    engine, loader, schedule = _engine_and_loader(config)
    assert engine.lr_scheduler is schedule and len(loader) == 5
    stream = iter(loader)
    seen = _train(engine, stream, 2)
    engine.save_checkpoint(str(tmp_path), client_state={"batches": loader.batch_sampler.state_dict()})
    seen += _train(engine, stream, 3)
    # two groups a step (train batch size 2): groups 0-1, 2-3, 4-5, 6-7, 8-9 of GROUPS; lr = 0.1 * samples / 2
    assert [samples for samples, _ in seen] == [sum(GROUPS[i : i + 2], []) for i in range(0, 10, 2)]
    assert [lr for _, lr in seen] == pytest.approx([0.2, 0.15, 0.25, 0.15, 0.2])
    resumed, resumed_loader, _ = _engine_and_loader(config)
    _, client = resumed.load_checkpoint(str(tmp_path))
    resumed_loader.batch_sampler.load_state_dict(client["batches"])
    assert _train(resumed, iter(resumed_loader), 3) == seen[2:]  # a fresh loader and schedule: seen[:3]


def test_config_and_metric_file(tmp_path: Path) -> None:
    base = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    section = {"enabled": True, "max_tokens": 10, "sequence_picking_order": "seqlen", "metrics_path": str(tmp_path)}
    efficiency = {"seed": 7, "data_sampling": {"num_workers": 2, "dynamic_batching": section}}
    plan = resolve({**base, "data_efficiency": efficiency}, world_size=1)
    batching = plan.schedules.dynamic_batching
    assert batching is not None and batching.order == "seqlen" and not plan.unimplemented
    loader, packing = variable_batch_loader(
        list(range(20)), LENGTHS, dataclasses.replace(batching, order="random"), batch_shape=(1, 1), rank_and_size=(0, 1)
    )
    assert loader.num_workers == 2 and packing.groups == group_by_tokens(
        LENGTHS, max_tokens=10, groups_per_batch=1, order="random", seed=7
    ).groups  # data_efficiency.seed orders the samples
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("slipstream")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        for verbose in (False, True):
            variable_batch_loader(list(range(20)), LENGTHS, dataclasses.replace(batching, verbose=verbose),
                                  batch_shape=(2, 4), rank_and_size=(0, 1))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert lines == [  # verbose only; by length, four groups a batch: BY_LENGTH
        "dynamic batching: global batch 0: 12 samples in groups [7, 14, 3, 10, 18] (8 tokens), [1, 9, 16] (9 tokens), "
        "[5, 12] (8 tokens), [19, 0] (9 tokens)",
        "dynamic batching: global batch 1: 4 samples in groups [11] (5 tokens), [6] (6 tokens), [15] (6 tokens), "
        "[4] (7 tokens)",
        "dynamic batching: global batch 2: 4 samples in groups [17] (7 tokens), [2] (8 tokens), [13] (8 tokens), "
        "[8] (9 tokens)",
    ]
    with pytest.raises(FileNotFoundError, match="seqlen_sample_to_metric"):
        seqlens_from_metrics(batching, 20)
    (tmp_path / "seqlen").mkdir()
    write_rows(str(tmp_path / "seqlen" / "seqlen_sample_to_metric"), [[n] for n in LENGTHS], "uint8")
    assert seqlens_from_metrics(batching, 20) == LENGTHS
    with pytest.raises(ConfigError, match="max_tokens"):
        resolve({**base, "data_efficiency": {"data_sampling": {"dynamic_batching": {"enabled": True}}}}, world_size=1)
    engine, *_ = slipstream.initialize(model=_Sum(), config=base)
    with pytest.raises(ValueError, match="dynamic_batching.enabled"):
        variable_batches([], engine, dataset_seqlens=[])

"""Which ranks form the expert-parallel and expert-data-parallel groups, with tensor and pipeline parallelism
(`expert_rank_layout`, DeepSpeed's `_get_expert_parallel_ranks`): exact rank lists written out by hand."""

from __future__ import annotations

import pytest

from slipstream.moe.groups import _get_expert_parallel_ranks, expert_rank_layout


def test_expert_and_data_with_tensor_parallelism() -> None:
    # 16 ranks, tensor parallel 2 (pairs 0-1, 2-3, ...), so data-parallel ranks 0,2,..,14 and 1,3,..,15
    ep, edp = expert_rank_layout(16, expert_parallel_size=4, tensor_parallel_size=2)
    assert ep == [[0, 2, 4, 6], [8, 10, 12, 14], [1, 3, 5, 7], [9, 11, 13, 15]]
    assert edp == [[0, 8], [2, 10], [4, 12], [6, 14], [1, 9], [3, 11], [5, 13], [7, 15]]
    assert _get_expert_parallel_ranks(16, 2, 4) == (ep, edp)


def test_data_before_expert_and_pipeline_stages() -> None:
    # 16 ranks, 2 pipeline stages of 8 (0-7, 8-15), tensor parallel 2: 4 data-parallel ranks per (stage, tp index)
    ep, edp = expert_rank_layout(
        16, expert_parallel_size=2, tensor_parallel_size=2, pipeline_parallel_size=2, data_before_expert=True
    )
    # stage 0, tp index 0: data-parallel 0,2,4,6 -> D + E takes every 2nd: [0,4], [2,6]
    assert ep[:4] == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert ep[4:] == [[8, 12], [10, 14], [9, 13], [11, 15]]
    assert edp[:4] == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert sorted(rank for group in ep for rank in group) == list(range(16))
    assert _get_expert_parallel_ranks(16, 2, 2, 2, True) == (ep, edp)


def test_without_model_parallelism_the_groups_are_runs_and_strides() -> None:
    ep, edp = expert_rank_layout(8, expert_parallel_size=4)
    assert ep == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert edp == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"expert_parallel_size": 2, "tensor_parallel_size": 3}, "not a multiple of tensor x pipeline"),
        ({"expert_parallel_size": 3}, "expert parallel size 3 does not divide the data-parallel size 8"),
        ({"expert_parallel_size": 0}, "every size must be positive"),
    ],
)
def test_sizes_that_do_not_divide_are_named(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        expert_rank_layout(8, **kwargs)

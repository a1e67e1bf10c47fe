"""Partition math of the bucket-major layout (no tensors, no process group)."""

from __future__ import annotations

import pytest

from slipstream.zero.layout import build_layout


def test_buckets_follow_reverse_order_and_pad_to_world() -> None:
    layout = build_layout([10, 7, 3, 20], world_size=4, bucket_numel=12)
    # reverse order: 20 (own bucket, larger than 12), then 3 + 7 = 10, then 10
    assert [b.param_indices for b in layout.buckets] == [(3,), (2, 1), (0,)]
    assert [b.numel for b in layout.buckets] == [20, 10, 10]
    assert [b.padded_numel for b in layout.buckets] == [20, 12, 12]
    assert [b.piece_numel for b in layout.buckets] == [5, 3, 3]
    assert [b.shard_offset for b in layout.buckets] == [0, 5, 8]
    assert layout.flat_numel == 44 and layout.shard_numel == 11
    assert [s.flat_offset for s in layout.slots] == [32, 23, 20, 0]
    assert layout.piece_range(layout.buckets[1], 2) == (26, 29)


def test_every_element_owned_exactly_once() -> None:
    numels = [13 * 37, 37, 37 * 37, 37, 37 * 5, 5, 0, 1]
    for world in (1, 2, 3, 4):
        layout = build_layout(numels, world_size=world, bucket_numel=500)
        owned = sorted(i for b in layout.buckets for r in range(world) for i in range(*layout.piece_range(b, r)))
        assert owned == list(range(layout.flat_numel))
        covered = sorted(i for s in layout.slots for i in range(s.flat_offset, s.flat_offset + s.numel))
        assert len(covered) == len(set(covered)) == sum(numels)
        assert layout.shard_numel * world == layout.flat_numel


@pytest.mark.parametrize(("world", "bucket"), [(0, 10), (2, 0)])
def test_bad_arguments(world: int, bucket: int) -> None:
    with pytest.raises(ValueError):
        build_layout([4], world_size=world, bucket_numel=bucket)


def test_buckets_hold_one_reduce_dtype_in_the_order_backward_completes_them() -> None:
    """[Note: buckets by reduce dtype]: each dtype fills buckets of its own; buckets ordered by their last member
    in reverse registration order; one dtype (or None everywhere) is the plain layout."""
    numels, dtypes = [10, 7, 3, 20, 4, 6], ["bf16", None, "bf16", None, None, "bf16"]
    layout = build_layout(numels, world_size=2, bucket_numel=12, reduce_dtypes=dtypes)
    # reverse order 5(b) 4 3 2(b) 1 0(b): bf16 fills [5, 2] then [0]; None fills [4], [3] (20 > 12), [1]
    assert [(b.param_indices, b.reduce_dtype) for b in layout.buckets] == [
        ((4,), None),
        ((3,), None),
        ((5, 2), "bf16"),
        ((1,), None),
        ((0,), "bf16"),
    ]
    for bucket in layout.buckets:
        assert {dtypes[i] for i in bucket.param_indices} == {bucket.reduce_dtype}
    covered = sorted(i for s in layout.slots for i in range(s.flat_offset, s.flat_offset + s.numel))
    assert len(covered) == len(set(covered)) == sum(numels)
    plain = build_layout(numels, world_size=2, bucket_numel=12)
    assert build_layout(numels, world_size=2, bucket_numel=12, reduce_dtypes=[None] * 6) == plain
    same = build_layout(numels, world_size=2, bucket_numel=12, reduce_dtypes=["bf16"] * 6)
    assert [b.param_indices for b in same.buckets] == [b.param_indices for b in plain.buckets]

"""SparseSelfAttention's master layout is broadcast from rank 0 on first use (DeepSpeed's layout
synchronisation): a random BigBird layout drawn differently on each of 2 gloo ranks ends up rank 0's on both,
and so do the outputs for the same inputs."""

from __future__ import annotations

import random

import torch

from tests.harness import run_distributed


def layout_case(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from slipstream.ops.sparse_attention import BigBirdSparsityConfig, SparseSelfAttention

    random.seed(rank)  # each rank draws its own random blocks
    module = SparseSelfAttention(BigBirdSparsityConfig(num_heads=2, block=4, num_random_blocks=2), max_seq_length=64)
    drawn = module.master_layout.clone()
    q, k, v = (torch.randn(1, 2, 32, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    out = module(q, k, v)
    return drawn, module.master_layout.clone(), out


def test_master_layout_is_rank_0s_on_every_rank() -> None:
    (drawn0, synced0, out0), (drawn1, synced1, out1) = run_distributed(layout_case, world_size=2)
    assert not torch.equal(drawn0, drawn1)  # the draws differed
    assert torch.equal(synced0, drawn0) and torch.equal(synced1, drawn0)
    torch.testing.assert_close(out1, out0, rtol=0, atol=0)

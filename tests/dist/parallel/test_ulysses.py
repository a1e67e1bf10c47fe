"""Ulysses `DistributedAttention` against unsharded SDPA on one spawn of 2 ranks: causal and not, seq-first and
batch-first layouts, grouped KV heads, a sequence length (7) the group does not divide; outputs and the
gradients of q, k and v. Also the collectives one layer issues per step."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.harness import run_distributed, run_subtests

CASES = [
    {"causal": True, "seq_first": True, "seq": 8, "kv_heads": 4},
    {"causal": False, "seq_first": True, "seq": 8, "kv_heads": 4},
    {"causal": True, "seq_first": False, "seq": 7, "kv_heads": 4},
    {"causal": False, "seq_first": False, "seq": 9, "kv_heads": 2},
    # [Note: Ulysses head chunks]: per-chunk swap + attention, recomputed in backward
    {"causal": True, "seq_first": False, "seq": 7, "kv_heads": 4, "head_chunks": 2},
    {"causal": False, "seq_first": True, "seq": 8, "kv_heads": 4, "head_chunks": 2},
    {"causal": True, "seq_first": True, "seq": 9, "kv_heads": 2, "head_chunks": 1},
]


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """q, k, v as [batch, seq, heads, dim]."""
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    if kh.shape[1] != qh.shape[1]:
        kh, vh = (t.repeat_interleave(qh.shape[1] // kh.shape[1], dim=1) for t in (kh, vh))
    return F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal).transpose(1, 2)


def one_case(
    rank: int, world: int, *, causal: bool, seq_first: bool, seq: int, kv_heads: int, head_chunks: int | None = None
) -> dict:
    from slipstream.comm import count_collectives
    from slipstream.sequence import DistributedAttention
    from slipstream.sequence.data import slice_bounds

    gen = torch.Generator().manual_seed(seq)
    q = torch.randn(2, seq, 4, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, seq, kv_heads, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    upstream = torch.randn(2, seq, 4, 8, generator=gen, dtype=torch.float64)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = _reference(*full, causal)
    (expected * upstream).sum().backward()

    start, end = slice_bounds(seq, rank, world)
    local = [t[:, start:end].clone() for t in (q, k, v)]
    if seq_first:
        local = [t.transpose(0, 1).contiguous() for t in local]
    local = [t.requires_grad_() for t in local]
    attn = DistributedAttention(None, None, scatter_idx=2, gather_idx=0 if seq_first else 1, head_chunks=head_chunks)
    with count_collectives() as counter:
        out = attn(*local, is_causal=causal)
        # in the caller's layout, contiguous: the caller's reshape to [.., heads * dim] is a view, not a copy made
        # while the swap's receive buffer is still referenced
        assert out.is_contiguous() and out.shape == local[0].shape
        grad_out = upstream[:, start:end]
        (out * (grad_out.transpose(0, 1) if seq_first else grad_out)).sum().backward()
    if seq_first:
        out = out.transpose(0, 1)
    grads = [t.grad.transpose(0, 1) if seq_first else t.grad for t in local]
    torch.testing.assert_close(out, expected[:, start:end], rtol=1e-10, atol=1e-10)
    for name, got, ref in zip("qkv", grads, full):
        torch.testing.assert_close(got, ref.grad[:, start:end], rtol=1e-10, atol=1e-10, msg=f"grad of {name}")
    return dict(counter.calls)


def dropout_recomputed(rank: int, world: int) -> dict:
    """With dropout, head_chunks=1 (recomputed in backward) equals the saved path: the backward restores the
    forward's RNG state, so it recomputes the same dropout mask."""
    from slipstream.sequence import DistributedAttention

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 4, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    results = []
    for chunks in (None, 1):
        local = [t.clone().requires_grad_() for t in (q, k, v)]
        torch.manual_seed(11 + rank)
        out = DistributedAttention(None, None, 2, 1, head_chunks=chunks)(*local, dropout_p=0.5)
        torch.manual_seed(99)  # the backward must not depend on the RNG state at backward time
        (out * out).sum().backward()
        results.append([out.detach(), *(t.grad for t in local)])
    for name, saved, recomputed in zip(["out", "q", "k", "v"], *results):
        torch.testing.assert_close(recomputed, saved, rtol=1e-10, atol=1e-10, msg=f"dropout: {name}")
    return {}


def bad_chunks(rank: int, world: int) -> dict:
    import pytest

    from slipstream.sequence import DistributedAttention

    q = torch.randn(1, 4, 4, 8)
    with pytest.raises(ValueError, match="head_chunks=4 does not divide"):
        DistributedAttention(None, None, 2, 1, head_chunks=4)(q, q, q)
    with pytest.raises(ValueError, match="head_chunks must be a positive int"):
        DistributedAttention(None, None, 2, 1, head_chunks=0)
    mask = torch.zeros(4, 4, requires_grad=True)
    with pytest.raises(NotImplementedError, match="attn_mask of the local attention requires grad"):
        DistributedAttention(None, None, 2, 1, head_chunks=1)(q, q, q, attn_mask=mask)
    return {}


def grid(rank: int, world: int) -> list[dict]:
    return run_subtests(CASES, lambda **case: one_case(rank, world, **case)) + [
        dropout_recomputed(rank, world),
        bad_chunks(rank, world),
    ]


def test_distributed_attention_equals_unsharded_attention() -> None:
    counts = run_distributed(grid, world_size=2)[0]
    # q, k, v and the output: one all-to-all each, forward and backward; the local lengths all-gathered once
    assert counts[0] == counts[3] == {"all_to_all": 8, "all_gather": 1}
    # head chunks: per chunk q, k, v and the output forward; q, k, v, the output gradient and 3 gradients back
    assert counts[4] == counts[5] == {"all_to_all": 2 * 11, "all_gather": 1}
    assert counts[6] == {"all_to_all": 11, "all_gather": 1}

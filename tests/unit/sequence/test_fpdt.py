"""FPDT on one process: chunked causal attention against SDPA (fp32 to 1e-5; chunk sizes that do not divide the
sequence; grouped KV heads), host offload against none (equal, with counted copies and reused host buffers),
saved device bytes that scale with the chunk and not with the sequence when offloading, and DeepSpeed's
FPDT_Attention / FPDT_FFN / FPDT_LogitsLoss / FPDT_InputConstruct against their plain computations."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from slipstream.sequence.fpdt import (
    FPDT_FFN,
    FPDT_Attention,
    FPDT_InputConstruct,
    FPDT_LogitsLoss,
    fpdt_token_order,
)
from slipstream.sequence.fpdt_attention import fpdt_attention
from slipstream.sequence.fpdt_store import DeviceChunks, HostChunks


def causal_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA on [batch, seq, heads, dim], KV heads repeated to the query's."""
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    if kh.shape[1] != qh.shape[1]:
        kh, vh = (t.repeat_interleave(qh.shape[1] // kh.shape[1], dim=1) for t in (kh, vh))
    return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True).transpose(1, 2)


def _inputs(seq: int, kv_heads: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, seq, 4, 8, generator=gen) * 2  # scores of a few units: the running max moves
    k, v = (torch.randn(2, seq, kv_heads, 8, generator=gen) for _ in range(2))
    return [q, k, v, torch.randn(2, seq, 4, 8, generator=gen)]


def _run(inputs: list[torch.Tensor], **kwargs: object) -> list[torch.Tensor]:
    *qkv, upstream = inputs
    leaves = [t.clone().requires_grad_() for t in qkv]
    out = fpdt_attention(*leaves, **kwargs) if kwargs else causal_reference(*leaves)
    (out * upstream).sum().backward()
    return [out.detach(), *(t.grad for t in leaves)]


@pytest.mark.parametrize(("seq", "chunk", "kv_heads"), [(13, 4, 4), (13, 5, 2), (7, 3, 1), (8, 8, 4), (5, 16, 4)])
@pytest.mark.parametrize("offload", [False, True])
def test_chunked_attention_equals_causal_sdpa(seq: int, chunk: int, kv_heads: int, offload: bool) -> None:
    inputs = _inputs(seq, kv_heads)
    expected = _run([t.double() for t in inputs])
    got = _run(inputs, chunk_size=chunk, store=HostChunks() if offload else DeviceChunks())
    for name, g, e in zip(["out", "dq", "dk", "dv"], got, expected):
        torch.testing.assert_close(g, e.float(), rtol=1e-5, atol=1e-5, msg=name)


def test_offload_equals_device_chunks_and_reuses_host_buffers() -> None:
    inputs = _inputs(13, 2, seed=1)
    store = HostChunks()
    kept = _run(inputs, chunk_size=4, store=DeviceChunks())
    first = _run(inputs, chunk_size=4, store=store)
    allocations, offloaded = store.stats.host_allocations, store.stats.offloaded
    second = _run(inputs, chunk_size=4, store=store)
    for a, b, c in zip(kept, first, second):
        assert torch.equal(a, b) and torch.equal(a, c)
    # 4 chunks: q, k, v, output, lse forward; the output gradient and row sums, and dq per (key, query>=key) pair
    assert offloaded == 4 * 5 + 4 * 2 + (4 + 3 + 2 + 1)
    assert store.stats.offloaded == 2 * offloaded
    assert store.stats.host_allocations == allocations  # the second step reuses the first step's buffers
    assert store.stats.fetched_on_demand > 0


def test_without_grad_only_keys_and_values_are_kept_and_released_at_once() -> None:
    q, k, v, _ = _inputs(13, 2, seed=4)
    store = HostChunks()
    with torch.no_grad():
        out = fpdt_attention(q, k, v, chunk_size=4, store=store)
        assert store.stats.offloaded == 4 * 2  # k and v of 4 chunks
        fpdt_attention(q, k, v, chunk_size=4, store=store)  # the first call's buffers are free again
    assert store.stats.host_allocations == 4 * 2
    torch.testing.assert_close(out, causal_reference(q, k, v), rtol=1e-5, atol=1e-5)


def _peak_saved(seq: int, chunk: int, store_type: type) -> int:
    store = store_type()
    _run(_inputs(seq, 4), chunk_size=chunk, store=store)
    return store.stats.device_bytes.peak


def test_saved_device_bytes_scale_with_the_chunk_when_offloading() -> None:
    # on the host: O(chunk) of saved chunks on the device at a time, whatever the sequence
    assert _peak_saved(64, 8, HostChunks) == _peak_saved(32, 8, HostChunks)
    assert _peak_saved(64, 16, HostChunks) == 2 * _peak_saved(64, 8, HostChunks)
    # kept on the device: the whole sequence's q, k, v and outputs (and more), whatever the chunk
    kept = _peak_saved(64, 8, DeviceChunks)
    assert kept >= 1.9 * _peak_saved(32, 8, DeviceChunks) and kept >= 8 * _peak_saved(64, 8, HostChunks)
    # ... but each output goes once its row sums are taken, and each chunk's tensors once its key chunk is done:
    # fewer than the 6 sequence-long tensors q, k, v, output, output gradient and dq at any time
    assert kept < 6 * 2 * 64 * 4 * 8 * 4


def test_chunked_attention_refuses_bad_shapes() -> None:
    q = torch.randn(1, 4, 4, 8)
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        fpdt_attention(q, q, q, chunk_size=0)
    with pytest.raises(ValueError, match="key/value heads must divide the query heads"):
        fpdt_attention(q, q[:, :, :3], q[:, :, :3], chunk_size=2)


def _config(heads: int = 4, kv_heads: int = 2) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        hidden_size=16, num_attention_heads=heads, num_key_value_heads=kv_heads, kv_channels=4, attention_dropout=0.0
    )


def rotary_tables(seq: int, width: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSpeed's rotary_pos_emb: (cos, sin), [seq, 1, 1, width], the frequencies repeated over both halves."""
    freqs = torch.outer(torch.arange(seq, dtype=torch.float64), 1.0 / 10000 ** (torch.arange(0, width, 2) / width))
    angles = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]
    return angles.cos(), angles.sin()


def _rotated(t: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """[batch, seq, heads, dim]: pairs (i, i + half) of the first `width` features turned by position's angle."""
    half = rotary[0].shape[-1] // 2
    cos, sin = (r[:, 0, 0, :half][None, :, None, :] for r in rotary)
    x1, x2 = t[..., :half], t[..., half : 2 * half]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, t[..., 2 * half :]), dim=-1)


def attention_reference(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    config: types.SimpleNamespace,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Plain attention of FPDT_Attention's weights on [seq, batch, hidden] `x`, bias added."""
    w1, b1, w2, b2 = weights
    q_width, kv_width = config.num_attention_heads * 4, config.num_key_value_heads * 4
    q, k, v = F.linear(x, w1, b1).transpose(0, 1).split([q_width, kv_width, kv_width], dim=-1)
    q = q.unflatten(-1, (config.num_attention_heads, 4))
    k, v = (t.unflatten(-1, (config.num_key_value_heads, 4)) for t in (k, v))
    if rotary is not None:
        q, k = _rotated(q, rotary), _rotated(k, rotary)
    out = causal_reference(q, k, v).flatten(2).transpose(0, 1)
    return F.linear(out, w2, b2)


def attention_weights(config: types.SimpleNamespace, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    width = (config.num_attention_heads + 2 * config.num_key_value_heads) * 4
    shapes = [(width, 16), (width,), (16, config.num_attention_heads * 4), (16,)]
    return [(torch.randn(s, generator=gen, dtype=torch.float64) * 0.3).requires_grad_() for s in shapes]


@pytest.mark.parametrize(("return_bias", "rotary"), [(True, False), (False, True)])
def test_fpdt_attention_module_equals_plain_attention(return_bias: bool, rotary: bool) -> None:
    config = _config()
    weights = attention_weights(config)
    x = torch.randn(11, 2, 16, dtype=torch.float64, requires_grad=True)
    tables = rotary_tables(11) if rotary else None
    layer = FPDT_Attention(config, *weights, None, return_bias=return_bias, chunk_size=4)
    out, bias = layer(x, None, None, tables)
    out = out + bias if return_bias else out
    assert (bias is weights[3]) == return_bias
    (out * out).sum().backward()
    got = [t.grad.clone() for t in (x, *weights)]
    for t in (x, *weights):
        t.grad = None
    expected = attention_reference(x, weights, config, tables)
    (expected * expected).sum().backward()
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    for g, t in zip(got, (x, *weights)):
        torch.testing.assert_close(g, t.grad, rtol=1e-10, atol=1e-10)
    assert layer.host_store.stats.offloaded > 0  # offloading is the default


def test_fpdt_attention_module_refusals() -> None:
    weights = attention_weights(_config())
    with pytest.raises(NotImplementedError, match="attention_dropout=0.1"):
        FPDT_Attention(types.SimpleNamespace(**{**vars(_config()), "attention_dropout": 0.1}), *weights, None)
    layer = FPDT_Attention(_config(), *weights, None, chunk_size=4)
    x = torch.zeros(4, 1, 16, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match="attention_mask must be None"):
        layer(x, torch.ones(4, 4))
    with pytest.raises(ValueError, match="rotary_pos_emb cos has shape \\(5, 1, 1, 2\\); expected \\[4, 1"):
        layer(x, None, None, rotary_tables(5))
    with pytest.raises(ValueError, match="only the \\[seq, batch, hidden\\] layout"):
        FPDT_Attention(_config(), *weights, None, gather_idx=1)


@pytest.mark.parametrize("add_bias", [True, False])
def test_fpdt_ffn_equals_the_mlp(add_bias: bool) -> None:
    gen = torch.Generator().manual_seed(2)
    shapes = [(11, 2, 16), (24, 16), (24,), (16, 24), (16,)]
    x, w1, b1, w2, b2 = (torch.randn(s, generator=gen, dtype=torch.float64).requires_grad_() for s in shapes)
    out, bias = FPDT_FFN.apply(x, w1, b1, w2, b2, add_bias, 4)
    assert (bias is None) == add_bias
    out = out if bias is None else out + bias
    (out * out).sum().backward()
    got = [t.grad.clone() for t in (x, w1, b1, w2, b2)]
    for t in (x, w1, b1, w2, b2):
        t.grad = None
    expected = F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)
    (expected * expected).sum().backward()
    torch.testing.assert_close(out, expected)
    for g, t in zip(got, (x, w1, b1, w2, b2)):
        torch.testing.assert_close(g, t.grad)


def test_fpdt_logits_loss_equals_cross_entropy() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(11, 2, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    head = torch.randn(10, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 10, (2, 11), generator=gen)
    losses = FPDT_LogitsLoss.apply(x, labels, head, 0, 1, None, 3)
    assert losses.shape == (11, 2)
    losses.mean().backward()
    got = [x.grad.clone(), head.grad.clone()]
    x.grad = head.grad = None
    logits = (x @ head.t()).flatten(0, 1)
    expected = F.cross_entropy(logits, labels.t().flatten(), reduction="none").view(11, 2)
    expected.mean().backward()
    torch.testing.assert_close(losses, expected.float())
    torch.testing.assert_close(got, [x.grad, head.grad])


def test_input_construct_lays_chunks_over_ranks() -> None:
    # 14 tokens, chunks of 4 (the last of 2), 2 ranks: each rank holds half of every chunk
    assert fpdt_token_order(14, 4, 2).tolist() == [0, 1, 4, 5, 8, 9, 12, 2, 3, 6, 7, 10, 11, 13]
    assert fpdt_token_order(13, 4, 1).tolist() == list(range(13))
    tokens = torch.arange(28).view(2, 14)
    args = types.SimpleNamespace(ds_sequence_parallel_fpdt_chunk_size=4)
    mask = torch.ones(2, 14)
    construct = FPDT_InputConstruct(tokens, tokens + 100, mask, None, tokens % 14, args, 2, 1)
    assert (construct.chunk_size, construct.num_chunk_per_gpu, construct.local_seq_len) == (2, 4, 7)
    got = construct.generate()
    local, labels, loss_mask, attention_mask, positions = got
    assert local[0].tolist() == [2, 3, 6, 7, 10, 11, 13]
    assert torch.equal(labels, local + 100) and torch.equal(positions, local % 14)
    assert loss_mask.shape == (2, 14) and attention_mask is None
    with pytest.raises(ValueError, match="multiples of the sequence-parallel size 2"):
        FPDT_InputConstruct(tokens[:, :13], None, None, None, None, args, 2, 0)
    with pytest.raises(ValueError, match="chunk size must be a positive int, got 0"):
        fpdt_token_order(14, 0, 2)

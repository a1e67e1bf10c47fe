"""Activation offload (`cpu_checkpointing`), the contiguous buffer (`contiguous_memory_optimization`,
`number_checkpoints`), `synchronize_checkpoint_boundary` and `profile` in one process, on a small
Llama-style stack whose MLP is checkpointed per sequence chunk (13 tokens in chunks of 4)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

from slipstream.activation import recompute
from slipstream.activation.live_bytes import LiveBytes, counting_saved

SEQ, CHUNK, WIDTH, LAYERS = 13, 4, 16, 4


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(WIDTH), nn.RMSNorm(WIDTH)
        self.qkv, self.out = nn.Linear(WIDTH, 3 * WIDTH, bias=False), nn.Linear(WIDTH, WIDTH, bias=False)
        self.gate_up, self.down = nn.Linear(WIDTH, 4 * WIDTH, bias=False), nn.Linear(2 * WIDTH, WIDTH, bias=False)

    def attention(self, h: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(h)).view(*h.shape[:2], 3, 2, -1).transpose(1, 3).unbind(2)
        mixed = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return h + self.out(mixed.transpose(1, 2).reshape(h.shape))

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(self.norm2(h)).chunk(2, dim=-1)
        return h + self.down(torch.nn.functional.silu(gate) * up)


Run = Callable[..., torch.Tensor]


def _forward(layers: nn.ModuleList, x: torch.Tensor, run: Run | None) -> torch.Tensor:
    h = x
    for layer in layers:
        h = layer.attention(h) if run is None else run(layer.attention, h)
        pieces = [layer.mlp(c) if run is None else run(layer.mlp, c) for c in h.split(CHUNK, dim=1)]
        h = torch.cat(pieces, dim=1)
    return h.pow(2).mean()


def _steps(run: Run | None, steps: int = 2) -> tuple[list[float], list[torch.Tensor]]:
    torch.manual_seed(0)
    layers = nn.ModuleList(_Layer() for _ in range(LAYERS))
    losses, grads = [], []
    for step in range(steps):
        x = torch.randn(2, SEQ, WIDTH, generator=torch.Generator().manual_seed(step), requires_grad=True)
        loss = _forward(layers, x, run)
        loss.backward()
        losses.append(loss.item())
        grads += [p.grad.clone() for p in layers.parameters()] + [x.grad.clone()]
        layers.zero_grad()
    return losses, grads


@pytest.fixture(scope="module")
def plain() -> tuple[list[float], list[torch.Tensor]]:
    """Two steps without checkpointing: what every checkpointed run must equal."""
    return _steps(None)


@pytest.fixture(autouse=True)
def fresh_settings() -> Iterator[None]:
    recompute.configure(None, checkpoint_in_cpu=False, contiguous_checkpointing=False, synchronize=False, profile=False)
    yield
    recompute.configure(None, checkpoint_in_cpu=False, contiguous_checkpointing=False, synchronize=False, profile=False)


def _assert_same(got: tuple[list[float], list[torch.Tensor]], expected: tuple[list[float], list[torch.Tensor]]) -> None:
    assert got[0] == pytest.approx(expected[0], rel=2e-5, abs=2e-5)
    for g, e in zip(got[1], expected[1], strict=True):
        torch.testing.assert_close(g, e, rtol=2e-5, atol=2e-5)


BOUNDARIES = LAYERS * (1 + -(-SEQ // CHUNK))  # checkpointed calls per forward


def test_offload_equals_no_offload_and_prefetches_every_input_but_the_first(plain: tuple) -> None:
    recompute.configure(None, checkpoint_in_cpu=True)
    _assert_same(_steps(recompute.checkpoint), plain)
    stats = recompute.store().stats
    assert stats.offloaded == 2 * BOUNDARIES  # every checkpointed input of both steps
    # each backward fetches its first input on demand and prefetches the rest, one ahead
    assert stats.fetched_on_demand == 2 and stats.prefetched == stats.offloaded - 2
    assert stats.host_allocations == BOUNDARIES  # one host buffer per input ordinal, reused by step 2


def test_offload_halves_the_peak_of_live_saved_activations() -> None:
    meter = LiveBytes()

    def counted(function: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
        with counting_saved(meter):
            return recompute.checkpoint(function, *args)

    _steps(counted, steps=1)
    recompute.configure(None, checkpoint_in_cpu=True)
    _steps(counted, steps=1)
    offloaded = recompute.store().stats.device_bytes
    assert meter.peak > 0 and offloaded.current == 0 and meter.current == 0
    assert offloaded.peak <= 0.5 * meter.peak, (offloaded.peak, meter.peak)


@pytest.mark.parametrize("to_host", [False, True])
def test_contiguous_buffer_holds_the_step_and_equals_no_checkpointing(to_host: bool, plain: tuple) -> None:
    recompute.configure(None, checkpoint_in_cpu=to_host, contiguous_checkpointing=True, num_checkpoints=BOUNDARIES)
    _assert_same(_steps(recompute.checkpoint), plain)
    store = recompute.store()
    assert store.stats.host_allocations == 1  # one buffer for float32, reused by step 2
    (flat,) = store._flat.values()
    assert flat.device.type == "cpu" and flat.numel() == BOUNDARIES * 2 * SEQ * WIDTH
    assert list(store._used.values()) == [LAYERS * 2 * (2 * SEQ * WIDTH)]  # step 2 packed from the start again


def test_contiguous_buffer_too_small_or_unsized_names_number_checkpoints() -> None:
    with pytest.raises(ValueError, match="needs number_checkpoints"):
        recompute.configure(None, contiguous_checkpointing=True, num_checkpoints=None)
    recompute.configure(None, contiguous_checkpointing=True, num_checkpoints=2)
    with pytest.raises(ValueError, match=r"number_checkpoints=2: the contiguous buffer"):
        _steps(recompute.checkpoint, steps=1)
    recompute.set_num_layers(BOUNDARIES)
    assert recompute.store().number_checkpoints == BOUNDARIES


def test_synchronize_and_profile_wrap_forward_and_recomputation(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    synced: list[int] = []
    accelerator = recompute.get_accelerator()
    monkeypatch.setattr(type(accelerator), "synchronize", lambda self, *a: synced.append(1))
    recompute.configure(None, synchronize=True, profile=True)
    layer = _Layer()
    with caplog.at_level(logging.INFO):
        recompute.checkpoint(layer.mlp, torch.randn(1, 3, WIDTH, requires_grad=True)).sum().backward()
    assert len(synced) == 4  # before and after the forward, and the recomputation
    messages = [r.getMessage() for r in caplog.records]
    assert any("checkpointed forward of" in m for m in messages)
    assert any("checkpointed recomputation of" in m for m in messages)


def test_the_config_section_honours_the_contiguous_keys() -> None:
    plan = recompute.activation_checkpoint_plan({"contiguous_memory_optimization": True, "number_checkpoints": 3})
    recompute.configure_from_plan(plan)
    assert recompute.store().contiguous and recompute.store().number_checkpoints == 3


def test_nested_checkpoints_with_offload_equal_no_offload() -> None:
    torch.manual_seed(0)
    a, b = nn.Linear(8, 8), nn.Linear(8, 8)
    x = torch.randn(3, 8, requires_grad=True)

    def outer(h: torch.Tensor) -> torch.Tensor:
        return recompute.checkpoint(lambda g: torch.tanh(b(g)), torch.sin(a(h))) * 2

    def run() -> tuple[float, list[torch.Tensor]]:
        loss = recompute.checkpoint(outer, x).pow(2).sum()
        loss.backward()
        grads = [t.grad.clone() for t in (*a.parameters(), *b.parameters(), x)]
        for t in (*a.parameters(), *b.parameters(), x):
            t.grad = None
        return loss.item(), grads

    expected = run()
    recompute.configure(None, checkpoint_in_cpu=True)
    got = run()
    _assert_same(([got[0]], got[1]), ([expected[0]], expected[1]))
    assert recompute.store().stats.offloaded >= 2

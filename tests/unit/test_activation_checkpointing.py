"""slipstream.checkpointing (DeepSpeed's deepspeed.checkpointing) in one process: equal to no checkpointing
(outputs, gradients, dropout masks), activations really dropped, options from configure() and the config."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

import slipstream
from slipstream.activation import recompute
from slipstream.config import ConfigError
from slipstream.utils.torch_versions import TorchTooOld


class _Block(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.up, self.down, self.drop = nn.Linear(width, 4 * width), nn.Linear(4 * width, width), nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(torch.relu(self.up(x))))


@pytest.fixture(autouse=True)
def fresh_settings() -> Iterator[None]:
    recompute.configure(None, partition_activations=False, checkpoint_in_cpu=False, synchronize=False, profile=False)
    yield
    recompute.configure(None, partition_activations=False, checkpoint_in_cpu=False, synchronize=False, profile=False)


def _run(blocks: nn.ModuleList, x: torch.Tensor, checkpointed: Callable | None) -> tuple[torch.Tensor, list]:
    torch.manual_seed(7)  # the same dropout masks for both runs, if recomputation restores the RNG
    h = x
    for block in blocks:
        h = block(h) if checkpointed is None else checkpointed(block, h)
    h.sum().backward()
    grads = [p.grad.clone() for p in blocks.parameters()] + [x.grad.clone()]
    blocks.zero_grad()
    x.grad = None
    return h.detach(), grads


@pytest.mark.parametrize("how", ["checkpoint", "cpu", "selective"])
def test_checkpointing_equals_no_checkpointing_with_dropout(how: str) -> None:
    torch.manual_seed(0)
    blocks = nn.ModuleList(_Block() for _ in range(3)).train()
    x = torch.randn(5, 16, requires_grad=True)
    expected, expected_grads = _run(blocks, x, None)
    if how == "selective" and not hasattr(torch.utils.checkpoint, "create_selective_checkpoint_contexts"):
        with pytest.raises(TorchTooOld, match=r"needs PyTorch >= 2\.5"):
            recompute.selective_checkpoint(blocks[0], x)
        return
    if how == "cpu":
        recompute.configure(None, checkpoint_in_cpu=True)
    run = recompute.selective_checkpoint if how == "selective" else recompute.checkpoint
    got, grads = _run(blocks, x, run)
    assert torch.equal(got, expected)
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(grads, expected_grads, strict=True))
    torch.manual_seed(8)  # another seed gives other masks: the comparison above can fail
    assert not torch.equal(blocks[0](x), blocks[0](x))


def test_checkpointed_activations_are_not_kept() -> None:
    torch.manual_seed(0)
    blocks = nn.ModuleList(_Block(64) for _ in range(4)).train()
    x = torch.randn(32, 64, requires_grad=True)

    def saved_bytes(run: Callable | None) -> int:
        total = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            h = x
            for block in blocks:
                h = block(h) if run is None else run(block, h)
        return total

    plain, checkpointed = saved_bytes(None), saved_bytes(recompute.checkpoint)
    assert checkpointed < plain / 4, (checkpointed, plain)


def test_configure_reads_the_config_section_and_arguments_win(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 1, "activation_checkpointing": {"cpu_checkpointing": true, "profile": true}}')
    recompute.configure(None, deepspeed_config=str(path), profile=False)
    assert recompute.is_configured()
    assert recompute._settings.cpu_checkpointing and not recompute._settings.profile
    with pytest.raises(ConfigError, match="activation_checkpointing.cpu_checkpointing"):
        recompute.configure(None, deepspeed_config={"activation_checkpointing": {"cpu_checkpointing": "yes"}})


def test_the_engine_applies_the_section_and_deepspeeds_names_resolve() -> None:
    assert slipstream.checkpointing is recompute
    assert recompute.non_reentrant_checkpoint is recompute.checkpoint
    engine, *_ = slipstream.initialize(
        model=nn.Linear(4, 4),
        config={
            "train_batch_size": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "activation_checkpointing": {"synchronize_checkpoint_boundary": True, "profile": True},
        },
    )
    assert recompute._settings.synchronize and recompute._settings.profile
    engine.destroy()


def test_rng_tracker_forks_a_separate_stream() -> None:
    tracker = recompute.get_cuda_rng_tracker()
    recompute.model_parallel_cuda_manual_seed(123)
    default_first = torch.rand(3)
    recompute.model_parallel_cuda_manual_seed(123)
    with tracker.fork():
        forked = torch.rand(3)
    assert torch.equal(torch.rand(3), default_first)  # the fork left the default stream where it was
    torch.manual_seed(123 + 2718)
    assert torch.equal(forked, torch.rand(3))  # model-parallel seed = seed + 2718 + tensor-parallel rank 0
    with pytest.raises(KeyError, match="no state named 'other'"):
        with tracker.fork("other"):
            pass
    with pytest.raises(ValueError, match="already used"):
        tracker.add("again", 123 + 2718)

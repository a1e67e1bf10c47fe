"""What every framework in bench/zero_step.py shares: the model, the data, the config, the timed loop, memory.

Owns the measurement, so Slipstream, PyTorch DDP (both run by bench/zero_step.py) and DeepSpeed (run by
bench/_deepspeed_peer.py in its own virtual environment) are timed by the same code on the same inputs.
It imports torch and the example model only: never slipstream, never deepspeed.

One run = one fresh pair of spawned rank processes (gloo, FileStore rendezvous in a temp dir), so that the
RSS high-water mark (`resource.getrusage(...).ru_maxrss`) belongs to that framework and stage alone. Each rank
times every step with `time.perf_counter()`; the step time of a step is the slowest rank's, and a run reports
the median over the timed steps (after `warmup` untimed ones).
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
GPT_DIR = ROOT / "examples" / "gpt"
if str(GPT_DIR) not in sys.path:
    sys.path.insert(0, str(GPT_DIR))

from data import CharDataset  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

StepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclasses.dataclass(kw_only=True, slots=True)
class BenchSpec:
    """The model, data and optimizer shared by every run; serialised to JSON for the DeepSpeed peer."""

    n_layer: int = 4
    n_embd: int = 256
    n_head: int = 8
    block_size: int = 64
    micro_batch: int = 4
    """Sequences per rank per step (gradient_accumulation_steps is 1: every step is an optimizer step)."""
    warmup: int = 5
    steps: int = 30
    """Timed steps after the warmup ones."""
    seed: int = 1234
    lr: float = 3e-4
    bucket_numel: int = 1_000_000
    """reduce_bucket_size / allgather_bucket_size (elements) for ZeRO; DDP gets the same bytes as bucket_cap_mb."""
    world_size: int = 2

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> BenchSpec:
        return cls(**json.loads(text))


def ds_config(spec: BenchSpec, *, stage: int) -> dict[str, Any]:
    """The DeepSpeed JSON config both Slipstream and DeepSpeed are given for `stage` (fp32, AdamW, clip 1.0)."""
    return {
        "train_micro_batch_size_per_gpu": spec.micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": spec.lr, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.01}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": spec.bucket_numel,
                              "allgather_bucket_size": spec.bucket_numel},
        "steps_per_print": 1_000_000,
    }


def build_model(spec: BenchSpec, vocab_size: int) -> GPT:
    torch.manual_seed(spec.seed)
    return GPT(GPTConfig(vocab_size=vocab_size, block_size=spec.block_size, n_layer=spec.n_layer,
                         n_head=spec.n_head, n_embd=spec.n_embd))


def make_batches(spec: BenchSpec, rank: int) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]:
    """(vocab size, this rank's warmup + timed micro-batches): the same samples for every framework."""
    dataset = CharDataset(block_size=spec.block_size)
    generator = torch.Generator().manual_seed(spec.seed * 1000 + rank)
    batches = []
    for _ in range(spec.warmup + spec.steps):
        indices = torch.randint(len(dataset), (spec.micro_batch,), generator=generator).tolist()
        samples = [dataset[i] for i in indices]
        batches.append((torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])))
    return dataset.vocab_size, batches


def rss_mib() -> float:
    """This process's RSS high-water mark in MiB (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def timed_loop(step: StepFn, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[list[float], list[float]]:
    """Run every batch through `step`; returns (seconds per step, local loss per step)."""
    times, losses = [], []
    for inputs, targets in batches:
        started = time.perf_counter()
        loss = step(inputs, targets)
        times.append(time.perf_counter() - started)
        losses.append(float(loss))
    return times, losses


def summarise(spec: BenchSpec, *, times: list[float], losses: list[float], owned_bytes: int | None,
              rss_before_mib: float, num_params: int) -> dict[str, Any] | None:
    """Gather the per-rank figures; rank 0 returns the run's summary, other ranks None."""
    mine = {"times": times[spec.warmup:], "losses": losses, "rss_mib": rss_mib(), "owned": owned_bytes,
            "rss_before_mib": rss_before_mib}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() != 0:
        return None
    slowest = [max(per_rank) for per_rank in zip(*(g["times"] for g in gathered))]
    mean_losses = [statistics.fmean(per_rank) for per_rank in zip(*(g["losses"] for g in gathered))]
    owned = [g["owned"] for g in gathered]
    return {
        "median_ms": 1000.0 * statistics.median(slowest),
        "mean_ms": 1000.0 * statistics.fmean(slowest),
        "peak_rss_mib": max(g["rss_mib"] for g in gathered),
        "rss_before_mib": max(g["rss_before_mib"] for g in gathered),
        "owned_mib": None if None in owned else max(owned) / 2**20,
        "first_loss": mean_losses[0],
        "final_loss": mean_losses[-1],
        "num_params": num_params,
    }


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of parameters, gradients and optimizer state (what the engines' owned_bytes() count)."""
    total = 0
    for param in model.parameters():
        total += param.numel() * param.element_size() * (2 if param.grad is not None else 1)
    for state in optimizer.state.values():
        total += sum(v.numel() * v.element_size() for v in state.values()
                     if isinstance(v, torch.Tensor) and v.dim() > 0)
    return total


def _rank_entry(rank: int, worker: Callable[..., dict[str, Any] | None], spec_json: str, run_dir: str,
                extra: dict[str, Any]) -> None:
    world_size = BenchSpec.from_json(spec_json).world_size
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(run_dir, "store"), world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(minutes=5))
    try:
        result = worker(rank, BenchSpec.from_json(spec_json), **extra)
        if result is not None:
            Path(run_dir, "result.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def spawn_run(worker: Callable[..., dict[str, Any] | None], spec: BenchSpec, **extra: Any) -> dict[str, Any]:
    """Run `worker(rank, spec, **extra)` on `spec.world_size` fresh ranks; returns rank 0's result."""
    with tempfile.TemporaryDirectory(prefix="zero_step_") as run_dir:
        mp.start_processes(_rank_entry, args=(worker, spec.to_json(), run_dir, extra), nprocs=spec.world_size,
                           start_method="spawn", join=True)
        return json.loads(Path(run_dir, "result.json").read_text())

"""What every framework in bench/zero_step.py shares: model, data, config, the rank server and its figures.

Owns the measurement, so Slipstream, PyTorch DDP (served by bench/zero_step.py) and DeepSpeed (served by
bench/_deepspeed_peer.py in its own virtual environment) are timed by the same code on the same inputs.
It imports torch and the example model only: never slipstream, never deepspeed.

[Note: rank servers]
A group is `world_size` rank processes started by the driver (gloo, FileStore rendezvous in a temp dir).
Each rank builds one runner per framework it hosts (its own model copy, seeded alike), then reads one JSON
command per line on stdin; the driver writes every command to every rank, so all ranks run the same
collectives in the same order. Rank 0 answers each command with one line on stdout that starts with
`REPLY_MARK` (library log lines are skipped by the driver). Commands:
    {"op": "run", "name": N, "steps": K}  K steps of runner N on its next K micro-batches; the reply has the
                                          per-step time of the slowest rank, the highest rank's CPU time per
                                          step (the process's, all its threads) and the mean loss over ranks
    {"op": "memory"}                      RSS high-water mark per rank (ru_maxrss) and engine-owned bytes
    {"op": "count", "name": N}            one step of runner N through its `count_step` (figures such as
                                          the all-gathers it issued), one value per rank for each key
    {"op": "quit"}
Idle ranks block on stdin, so a group that is not running costs no CPU: the driver alternates short chunks
of steps between frameworks and groups, and drift in machine load hits all of them alike.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import resource
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
GPT_DIR = ROOT / "examples" / "gpt"
if str(GPT_DIR) not in sys.path:
    sys.path.insert(0, str(GPT_DIR))

from data import CharDataset
from model import GPT, GPTConfig

REPLY_MARK = "@@zero_step "
StepFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
CountFn = Callable[[torch.Tensor, torch.Tensor], dict[str, int]]


@dataclasses.dataclass(kw_only=True, slots=True)
class BenchSpec:
    """The model, data and optimizer shared by every run; passed to the ranks as JSON."""

    n_layer: int = 4
    n_embd: int = 256
    n_head: int = 8
    block_size: int = 64
    micro_batch: int = 4
    """Sequences per rank per step (gradient_accumulation_steps is 1: every step is an optimizer step)."""
    num_batches: int = 64
    """Distinct micro-batches per rank; a runner cycles through them."""
    seed: int = 1234
    lr: float = 3e-4
    bucket_numel: int = 1_000_000
    """reduce_bucket_size / allgather_bucket_size (elements); DDP gets the same bytes as bucket_cap_mb."""
    world_size: int = 2
    model: str = "gpt"
    """"gpt": the example GPT (n_layer x n_embd, n_head); "mlp": `MLPStack`, n_layer Linear(n_embd, n_embd) + ReLU
    blocks on random inputs and targets (micro_batch rows each), MSE loss: the wide-layer model of the ZeRO benches;
    "blocks": `ResidualBlocks`, n_layer residual blocks LayerNorm -> Linear(n_embd, hidden) -> GELU ->
    Linear(hidden, n_embd) on the same kind of inputs, MSE loss."""
    hidden: int = 4096
    """Inner width of the "blocks" model."""
    default_config: bool = False
    """The DeepSpeed JSON carries only batch, optimizer, clipping and the stage (with any offload section):
    no bucket sizes and no persistence threshold, so every framework runs on DeepSpeed's defaults."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> BenchSpec:
        return cls(**json.loads(text))


@dataclasses.dataclass(slots=True)
class Runner:
    """One framework on this rank: its step (forward + backward + optimizer step) and its owned bytes."""

    step: StepFn
    owned_bytes: Callable[[], int | None]
    model: nn.Module
    cursor: int = 0
    count_step: CountFn | None = None
    """One step that returns what it counted on this rank (e.g. {"all_gather": 9}); for the "count" op."""


Factory = Callable[[BenchSpec, nn.Module], Runner]


def ds_config(spec: BenchSpec, *, stage: int) -> dict[str, Any]:
    """The DeepSpeed JSON both Slipstream and DeepSpeed get for `stage` (fp32, AdamW, clip 1.0)."""
    return {
        "train_micro_batch_size_per_gpu": spec.micro_batch,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": spec.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01},
        },
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage}
        if spec.default_config
        else {"stage": stage, "reduce_bucket_size": spec.bucket_numel, "allgather_bucket_size": spec.bucket_numel},
        "steps_per_print": 1_000_000,
    }


class MLPStack(nn.Module):
    """`n_layer` blocks of Linear(width, width) + ReLU; `forward(inputs, targets)` returns the MSE loss, so it
    drops into every runner where the GPT does (`model.blocks` is what FSDP2 wraps)."""

    def __init__(self, n_layer: int, width: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(n_layer))

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            inputs = block(inputs)
        return nn.functional.mse_loss(inputs, targets)


class ResidualBlocks(nn.Module):
    """`n_layer` residual blocks x + Linear(hidden, width)(GELU(Linear(width, hidden)(LayerNorm(x)))); like
    `MLPStack`, `forward(inputs, targets)` returns the MSE loss and `model.blocks` is what FSDP2 wraps."""

    def __init__(self, n_layer: int, width: int, hidden: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, width))
            for _ in range(n_layer)
        )

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            inputs = inputs + block(inputs)
        return nn.functional.mse_loss(inputs, targets)


def model_spec(model: str, *, quick: bool = False, default_config: bool = False) -> BenchSpec:
    """The BenchSpec of a `--model` choice: "gpt" (the example GPT, 3.19M), "mlp" (48 x Linear(1024, 1024),
    50.4M, micro batch 64 rows) or "blocks" (6 residual blocks 1024 -> 4096 -> 1024, 50.4M, micro batch 32
    rows); `quick` shrinks the wide models to a smoke-test size."""
    if model == "mlp":
        return BenchSpec(model="mlp", n_layer=8 if quick else 48, n_embd=256 if quick else 1024, micro_batch=64,
                         num_batches=8, default_config=default_config)
    if model == "blocks":
        return BenchSpec(model="blocks", n_layer=2 if quick else 6, n_embd=256 if quick else 1024,
                         hidden=1024 if quick else 4096, micro_batch=32, num_batches=8, default_config=default_config)
    return BenchSpec(default_config=default_config)


def describe_model(spec: BenchSpec) -> str:
    """One phrase naming the model of `spec`, for the benchmarks' headers."""
    if spec.model == "mlp":
        return f"MLP {spec.n_layer} x Linear({spec.n_embd}, {spec.n_embd}), micro batch {spec.micro_batch} rows"
    if spec.model == "blocks":
        return (f"{spec.n_layer} residual blocks LayerNorm -> Linear({spec.n_embd}, {spec.hidden}) -> GELU -> "
                f"Linear({spec.hidden}, {spec.n_embd}), micro batch {spec.micro_batch} rows")
    return f"GPT {spec.n_layer} layers x {spec.n_embd}, micro batch {spec.micro_batch} x {spec.block_size} tokens"


def build_model(spec: BenchSpec, vocab_size: int) -> nn.Module:
    torch.manual_seed(spec.seed)
    if spec.model == "mlp":
        return MLPStack(spec.n_layer, spec.n_embd)
    if spec.model == "blocks":
        return ResidualBlocks(spec.n_layer, spec.n_embd, spec.hidden)
    return GPT(
        GPTConfig(
            vocab_size=vocab_size,
            block_size=spec.block_size,
            n_layer=spec.n_layer,
            n_head=spec.n_head,
            n_embd=spec.n_embd,
        )
    )


def make_batches(spec: BenchSpec, rank: int) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]:
    """(vocab size, this rank's micro-batches): the same samples for every framework."""
    if spec.model in ("mlp", "blocks"):
        generator = torch.Generator().manual_seed(spec.seed * 1000 + rank)
        shape = (spec.micro_batch, spec.n_embd)
        return 0, [
            (torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
            for _ in range(spec.num_batches)
        ]
    dataset = CharDataset(block_size=spec.block_size)
    generator = torch.Generator().manual_seed(spec.seed * 1000 + rank)
    batches = []
    for _ in range(spec.num_batches):
        indices = torch.randint(len(dataset), (spec.micro_batch,), generator=generator).tolist()
        samples = [dataset[i] for i in indices]
        batches.append((torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])))
    return dataset.vocab_size, batches


def rss_mib() -> float:
    """This process's RSS high-water mark in MiB (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of parameters, gradients (counted as allocated) and optimizer state, as owned_bytes() counts."""
    total = sum(2 * p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    for state in optimizer.state.values():
        total += sum(
            v.numel() * v.element_size()
            for v in state.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        )
    return total


def ds3_config(
    spec: BenchSpec,
    *,
    offload_optimizer: bool = False,
    offload_param: bool = False,
    persistence_threshold: int = 10_000,
) -> dict[str, Any]:
    """`ds_config(spec, stage=3)` with block weights sharded (parameters under `persistence_threshold`
    elements, the biases and LayerNorms, stay whole; with `spec.default_config`, DeepSpeed's default threshold)
    and optionally the CPU offload sections."""
    config = ds_config(spec, stage=3)
    zero = config["zero_optimization"]
    if not spec.default_config:
        zero["stage3_param_persistence_threshold"] = persistence_threshold
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    if offload_param:
        zero["offload_param"] = {"device": "cpu"}
    return config


ALL_GATHER_FUNCTIONS = ("all_gather_single", "all_gather_into_tensor", "_all_gather_base", "all_gather")


class TorchAllGatherCounter:
    """Counts calls of the torch.distributed all-gather functions while `counting()` is open.

    `install()` replaces `ALL_GATHER_FUNCTIONS` in both `torch.distributed` and
    `torch.distributed.distributed_c10d` with counting wrappers. It must run before a framework captures
    one of them (DeepSpeed's TorchBackend keeps `torch.distributed.all_gather_into_tensor` from its init).
    Only the outermost call counts: `all_gather_into_tensor` calling `all_gather_single` is one all-gather.
    """

    def __init__(self) -> None:
        self.calls = 0
        self._active = False
        self._depth = 0
        self._installed = False

    def install(self) -> None:
        if self._installed:
            return
        c10d = dist.distributed_c10d
        for name in ALL_GATHER_FUNCTIONS:
            original = getattr(c10d, name, None)
            if original is None:
                continue
            wrapper = self._wrap(original)
            setattr(c10d, name, wrapper)
            if getattr(dist, name, None) is original:
                setattr(dist, name, wrapper)
        self._installed = True

    def _wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._active and self._depth == 0:
                self.calls += 1
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    def count_step(self, step: StepFn) -> CountFn:
        """A `Runner.count_step` that runs `step` once and reports {"all_gather": calls during it}."""

        def counted_step(inputs: torch.Tensor, targets: torch.Tensor) -> dict[str, int]:
            assert self._installed, "install() the counter before building the runner"
            self.calls, self._active = 0, True
            try:
                step(inputs, targets)
            finally:
                self._active = False
            return {"all_gather": self.calls}

        return counted_step


ALL_GATHERS = TorchAllGatherCounter()
"""The process-wide counter (one per rank server)."""


def _gather(value: Any) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _run(runner: Runner, batches: list[tuple[torch.Tensor, torch.Tensor]], steps: int) -> dict[str, Any]:
    times, cpu_times, losses = [], [], []
    for _ in range(steps):
        inputs, targets = batches[runner.cursor % len(batches)]
        runner.cursor += 1
        started, cpu_started = time.perf_counter(), time.process_time()
        loss = runner.step(inputs, targets)
        times.append(time.perf_counter() - started)
        cpu_times.append(time.process_time() - cpu_started)
        losses.append(float(loss))
    per_rank = _gather((times, losses, cpu_times))
    return {
        "times": [max(t) for t in zip(*(r[0] for r in per_rank))],
        "losses": [sum(v) / len(v) for v in zip(*(r[1] for r in per_rank))],
        "cpu_times": [max(t) for t in zip(*(r[2] for r in per_rank))],
    }


def _count(runner: Runner, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, list[int]]:
    """One counted step of `runner`: {key: [value on rank 0, value on rank 1, ...]}."""
    if runner.count_step is None:
        raise ValueError("this runner has no count_step; build its Runner with one to use the count op")
    inputs, targets = batches[runner.cursor % len(batches)]
    runner.cursor += 1
    per_rank = _gather(runner.count_step(inputs, targets))
    return {key: [figures[key] for figures in per_rank] for key in per_rank[0]}


def _reply(rank: int, payload: dict[str, Any]) -> None:
    if rank == 0:
        sys.stdout.write(REPLY_MARK + json.dumps(payload) + "\n")
        sys.stdout.flush()


def serve(factories: dict[str, Factory], *, names: list[str], rank: int, spec: BenchSpec, store: str) -> None:
    """The rank server of [Note: rank servers], hosting `names` (keys of `factories`)."""
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(spec.world_size),
            "LOCAL_WORLD_SIZE": str(spec.world_size),
            "OMP_NUM_THREADS": "1",
        }
    )
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store, spec.world_size),
        rank=rank,
        world_size=spec.world_size,
        timeout=timedelta(minutes=10),
    )
    try:
        vocab_size, batches = make_batches(spec, rank)
        runners: dict[str, Runner] = {}
        rss_before = rss_mib()
        for name in names:
            runners[name] = factories[name](spec, build_model(spec, vocab_size))
        num_params = sum(p.numel() for p in next(iter(runners.values())).model.parameters())
        _reply(rank, {"ready": True, "num_params": num_params})
        for line in sys.stdin:
            command = json.loads(line)
            if command["op"] == "quit":
                break
            if command["op"] == "run":
                _reply(rank, _run(runners[command["name"]], batches, int(command["steps"])))
            elif command["op"] == "count":
                _reply(rank, _count(runners[command["name"]], batches))
            elif command["op"] == "memory":
                owned = {name: runner.owned_bytes() for name, runner in runners.items()}
                figures = _gather({"rss_mib": rss_mib(), "rss_before_mib": rss_before, "owned": owned})
                _reply(
                    rank,
                    {
                        "peak_rss_mib": max(f["rss_mib"] for f in figures),
                        "rss_before_mib": max(f["rss_before_mib"] for f in figures),
                        "owned_mib": {
                            name: None
                            if any(f["owned"][name] is None for f in figures)
                            else max(f["owned"][name] for f in figures) / 2**20
                            for name in names
                        },
                    },
                )
            else:
                raise ValueError(f"unknown command {command!r}")
    finally:
        dist.destroy_process_group()


def serve_main(factories: dict[str, Factory], argv: list[str]) -> None:
    """`--serve RANK STORE SPEC_JSON NAME[,NAME...]`: the command line the driver starts each rank with."""
    rank, store, spec_json, names = argv[argv.index("--serve") + 1 :][:4]
    serve(factories, names=names.split(","), rank=int(rank), spec=BenchSpec.from_json(spec_json), store=store)

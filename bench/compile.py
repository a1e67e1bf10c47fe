"""Benchmark of `engine.compile()`: step time compiled vs eager at ZeRO 0, 2 and 3, the first compiled step's
time (when compiling happens) and peak memory, on 2 ranks (gloo on CPU, one thread each), for Slipstream, for
torch's own FSDP2 (`fully_shard` per block, each block compiled with `torch.compile`; stages 2 and 3), and in
the peer environment (.bench-venv) for DeepSpeed's `engine.compile()` and for its DeepCompile
(`compile.deepcompile: true`, stage 3), or what fails there.

    python bench/compile.py [--backend inductor] [--steps 8] [--layers 4] [--dim 128] [--seq 64] [--rows ...]
                            [--stages 0 2 3] [--peer-python .bench-venv/bin/python]

The model is a small Llama-style decoder (RMSNorm, rotary-free causal attention through SDPA, SwiGLU MLP) in
an `nn.ModuleList`, built from one seed on every rank. Per stage, each framework builds an eager engine and a
compiled one side by side; after one step each (the compiled one compiles in it) they take turns on the same
`--steps` micro-batches, so a burst of other work on a shared machine slows both steps of a pair. The ratio
printed (compiled / eager, lower is better) is the median of the pairs' ratios, on the wall clock and on the
rank's CPU time (steadier on a loaded machine); nothing is asserted. Peak memory is the rank's peak resident set
(both engines). This file imports slipstream only in Slipstream's
rows and deepspeed only in DeepSpeed's (run by the peer interpreter), so one file serves both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parent.parent

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

STAGES = (0, 2, 3)
HEADS, VOCAB, MICRO = 4, 512, 4


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class LlamaBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(dim), RMSNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.gate, self.up = nn.Linear(dim, 4 * dim, bias=False), nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.out(y)
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class TinyLlama(nn.Module):
    def __init__(self, layers: int, dim: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(LlamaBlock(dim) for _ in range(layers))
        self.norm, self.head = RMSNorm(dim), nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.layers:
            x = block(x)
        return F.cross_entropy(self.head(self.norm(x)).flatten(0, 1), targets.flatten())


def ds_config(stage: int) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 1.0, "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": stage}}


def batches(rank: int, count: int, seq: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + rank)
    tokens = [torch.randint(0, VOCAB, (MICRO, seq + 1), generator=gen) for _ in range(count)]
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


class Fsdp2Engine:
    """torch's own FSDP2 (`fully_shard` on every block, then on the root) with AdamW and clipping at 1.0, behind
    the engine calls the benchmark makes. Stage 3 reshards each block after its forward (ZeRO-3); stage 2 keeps
    the gathered parameters until the backward (`reshard_after_forward=False`: gradients are still
    reduce-scattered, as in ZeRO-2). `compile()` compiles each block with `nn.Module.compile` (FSDP2's hooks stay
    out of the graph: dynamo skips them by default), the regional compilation `engine.compile()` does."""

    def __init__(self, model: TinyLlama, stage: int) -> None:
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch < 2.6
            from torch.distributed._composable.fsdp import fully_shard
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.layers:
            fully_shard(block, mesh=mesh, reshard_after_forward=stage == 3)
        fully_shard(model, mesh=mesh, reshard_after_forward=stage == 3)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def __call__(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.model(tokens, targets)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def compile(self, backend: str) -> None:
        for block in self.model.layers:
            block.compile(backend=backend)

    def destroy(self) -> None:
        pass


def build(framework: str, stage: int, args: argparse.Namespace, *, compiled: bool) -> Any:
    """An engine of `framework` at `stage`; the DeepCompile row's eager twin is DeepSpeed's plain engine."""
    model = TinyLlama(args.layers, args.dim)
    if framework == "fsdp2":
        if stage not in (2, 3):
            raise ValueError(f"fsdp2 has no ZeRO-{stage} counterpart (fully_shard is stage 2 or 3)")
        return Fsdp2Engine(model, stage)
    config = ds_config(stage)
    if framework == "slipstream":
        import slipstream as library
    else:
        import deepspeed as library  # the peer environment only
        if framework == "deepcompile" and compiled:
            config["compile"] = {"deepcompile": True}
    engine, _, _, _ = library.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


PHASES = ("forward", "backward", "step")


def timed_step(engine: Any, tokens: torch.Tensor, targets: torch.Tensor) -> list[float]:
    """Seconds of the forward, the backward and the optimizer step of one training step: wall clock, then the
    rank's CPU time (`time.process_time`, all its threads) for the same three. On a machine shared with other
    jobs wall time grows with the load and CPU time much less, so the CPU ratio is the steadier one."""
    dist.barrier()
    marks = [(time.perf_counter(), time.process_time())]
    loss = engine(tokens, targets)
    marks.append((time.perf_counter(), time.process_time()))
    engine.backward(loss)
    marks.append((time.perf_counter(), time.process_time()))
    engine.step()
    marks.append((time.perf_counter(), time.process_time()))
    return [after[clock] - before[clock] for clock in (0, 1) for before, after in zip(marks, marks[1:])]


def summary(eager: list[list[float]], compiled: list[list[float]]) -> dict[str, Any]:
    """Medians over the timed steps (the first of each excluded): step, each phase, and the pairs' ratio."""
    eager, compiled = eager[1:], compiled[1:]
    wall, cpu = slice(0, len(PHASES)), slice(len(PHASES), None)
    phases = {
        f"{kind}_{phase}{clock}_s": statistics.median(times[i + offset] for times in steps)
        for kind, steps in (("eager", eager), ("compiled", compiled))
        for clock, offset in (("", 0), ("_cpu", len(PHASES)))
        for i, phase in enumerate(PHASES)
    }

    def medians(part: slice) -> dict[str, float]:
        return {"eager": statistics.median(sum(e[part]) for e in eager),
                "compiled": statistics.median(sum(c[part]) for c in compiled),
                "ratio": statistics.median(sum(c[part]) / sum(e[part]) for c, e in zip(compiled, eager))}

    on_wall, on_cpu = medians(wall), medians(cpu)
    return {"eager_s": on_wall["eager"], "compiled_s": on_wall["compiled"], "ratio": on_wall["ratio"],
            "eager_cpu_s": on_cpu["eager"], "compiled_cpu_s": on_cpu["compiled"], "cpu_ratio": on_cpu["ratio"],
            **phases}


def one_stage(framework: str, stage: int, args: argparse.Namespace, rank: int) -> dict[str, Any]:
    """The eager and the compiled engine live side by side and take turns, step by step, on the same batches:
    on a shared machine a burst of other work then slows both of a pair, and the median of the pairs' ratios
    is the ratio reported."""
    data = batches(rank, args.steps + 1, args.seq)
    torch._dynamo.reset()
    eager = build(framework, stage, args, compiled=False)
    eager_times = [timed_step(eager, *data[0])]
    try:
        compiled = build(framework, stage, args, compiled=True)
        compiled.compile(backend=args.backend)
        compiled_times = [timed_step(compiled, *data[0])]
        if framework == "deepcompile" and not compiled.is_deepcompile_active():
            raise RuntimeError("engine.compile() fell back to torch.compile: DeepCompile is not active")
    except Exception as exc:  # DeepSpeed's failures are a result of this benchmark, reported as such
        return {"eager_s": sum(eager_times[0][:len(PHASES)]), "error": f"{type(exc).__name__}: {exc}".splitlines()[0],
                "trace": traceback.format_exc()[-600:]}
    for tokens, targets in data[1:]:
        eager_times.append(timed_step(eager, tokens, targets))
        compiled_times.append(timed_step(compiled, tokens, targets))
    eager.destroy()
    compiled.destroy()
    first = sum(compiled_times[0][:len(PHASES)])
    return {**summary(eager_times, compiled_times), "first_s": first, "peak_rss_mib": peak_rss_mib()}


def peak_rss_mib() -> float:
    """This process's peak resident memory (both engines, compiled code included), in MiB."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rank_main(rank: int, framework: str, store_path: str, args: argparse.Namespace, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    results = {}
    for stage in args.stages:
        if framework == "fsdp2" and stage not in (2, 3):
            continue  # fully_shard has no ZeRO-0 counterpart
        results[stage] = one_stage(framework, stage, args, rank)
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def run_framework(framework: str, args: argparse.Namespace) -> dict[str, Any]:
    """Both ranks of one framework, in this interpreter (spawned)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.start_processes(rank_main, args=(framework, os.path.join(tmp, "store"), args, out), nprocs=2,
                           start_method="spawn")
        return json.loads(Path(out).read_text())


def run_peer(framework: str, stages: list[int], args: argparse.Namespace) -> dict[str, Any] | str:
    """One DeepSpeed row (`deepspeed` or `deepcompile`), run by the peer interpreter; a string says why not."""
    python = Path(args.peer_python)
    if not python.exists():
        return f"no peer environment ({python}); bench/make_peer_venv.sh creates it"
    argv = [str(python), __file__, "--framework", framework, "--json", "--backend", args.backend,
            "--steps", str(args.steps), "--layers", str(args.layers),
            "--dim", str(args.dim), "--seq", str(args.seq),
            "--stages", *map(str, stages)]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=3600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        return f"{framework} run failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]}"
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def print_table(name: str, results: dict[str, Any]) -> None:
    for stage, row in results.items():
        eager = row["eager_s"] * 1e3
        if "error" in row:
            print(f"{name:<11} ZeRO-{stage}  eager {eager:7.1f} ms   compiled: FAILED {row['error'][:300]}")
            continue
        compiled, first = row["compiled_s"] * 1e3, row["first_s"]
        print(f"{name:<11} ZeRO-{stage}  eager {eager:7.1f} ms  compiled {compiled:7.1f} ms  "
              f"ratio {row['ratio']:5.2f}x (median of pairs)  first compiled step {first:6.1f} s  "
              f"peak RSS {row['peak_rss_mib']:6.0f} MiB")
        print(f"{'':<11} ZeRO-{stage}  CPU time: eager {row['eager_cpu_s'] * 1e3:7.1f} ms  compiled "
              f"{row['compiled_cpu_s'] * 1e3:7.1f} ms  ratio {row['cpu_ratio']:5.2f}x (median of pairs)")
        for kind in ("eager", "compiled"):
            parts = "  ".join(f"{phase} {row[f'{kind}_{phase}_s'] * 1e3:7.1f} ms "
                              f"(CPU {row[f'{kind}_{phase}_cpu_s'] * 1e3:6.1f})" for phase in PHASES)
            print(f"{'':<11} ZeRO-{stage}  {kind:<8} {parts}")


ROWS = ("slipstream", "fsdp2", "deepspeed", "deepcompile")
"""Slipstream's engine.compile(); torch's fully_shard + per-block torch.compile (stages 2 and 3); DeepSpeed's
engine.compile() and DeepSpeed's DeepCompile (`compile.deepcompile: true`, stage 3 only), both in the peer."""


def run_row(row: str, args: argparse.Namespace) -> dict[str, Any] | str:
    if row in ("slipstream", "fsdp2"):
        return run_framework(row, args)
    stages = [3] if row == "deepcompile" else args.stages
    return run_peer(row, [s for s in stages if s in args.stages], args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--stages", type=int, nargs="+", default=list(STAGES), help="ZeRO stages to run")
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS), help="frameworks to run")
    parser.add_argument("--framework", choices=ROWS, default="slipstream")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON line (peer runs)")
    parser.add_argument("--peer-python", default=str(ROOT / ".bench-venv" / "bin" / "python"))
    args = parser.parse_args()
    if args.json:
        print(json.dumps(run_framework(args.framework, args)))
        return
    print(f"engine.compile(backend={args.backend!r}): {args.layers}-block Llama-style model, dim {args.dim}, "
          f"seq {args.seq}, micro-batch {MICRO}, 2 ranks (gloo, 1 thread each); median of {args.steps} steps; "
          f"load average {os.getloadavg()[0]:.1f}")
    results: dict[str, dict[str, Any]] = {}
    for row in args.rows:
        found = run_row(row, args)
        if isinstance(found, str):
            print(f"{row:<11} {found}")
            continue
        results[row] = found
        print_table(row, found)
    for stage in map(str, args.stages):
        ours = results.get("slipstream", {}).get(stage, {})
        for peer in ROWS[1:]:
            theirs = results.get(peer, {}).get(stage, {})
            if "compiled_s" in ours and "compiled_s" in theirs:
                print(f"ZeRO-{stage}: Slipstream compiled step / {peer} compiled step = "
                      f"{ours['compiled_s'] / theirs['compiled_s']:.2f}x (CPU time "
                      f"{ours['compiled_cpu_s'] / theirs['compiled_cpu_s']:.2f}x)")
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    main()

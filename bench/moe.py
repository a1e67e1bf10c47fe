"""Benchmark of a small MoE transformer: Slipstream's MoE against DeepSpeed's MoE and the dense equivalent.

    python bench/moe.py [--size small|medium|large] [--quick] [--steps 20] [--warmup 3] [--peer-python ...]

Sizes (2 layers, 8 experts, ep 2, micro batch 8): `small` (the default) d_model 128, expert ffn 256, seq 64,
vocab 512 (per-op and per-collective overheads dominate: a step is tens of ms); `medium` d 256, ffn 1024, seq
128, vocab 1024; `large` d 512, ffn 2048, seq 128, vocab 2048 (compute dominates, as in real MoE models).

Rows (2 ranks, gloo on CPU, one thread each, ZeRO-2, fp32 AdamW, clip 1.0), for top-1 and top-2:
- `slipstream-moe`: blocks of attention + `slipstream.moe.layer.MoE` (8 experts, ep_size 2: 4 per rank);
- `deepspeed-moe`: the same model with `deepspeed.moe.layer.MoE`, run in the peer environment (.bench-venv,
  bench/make_peer_venv.sh); skipped when that is missing;
- `slipstream-dense`: the dense equivalent, the same blocks with one MLP of the active size (top-1: one expert's
  hidden width; top-2: twice that), under Slipstream.
Each row is its own 2-rank group (a fresh process per rank, started by this driver with `--worker`); each rank
trains `--warmup` steps, then `--steps` timed steps, and reports the median step time of the slowest rank (wall
clock, and CPU time of the process, which a loaded machine disturbs less), the tokens per second over both ranks
and its peak RSS. `--rounds` fresh groups per row, interleaved; the medians over rounds are printed. The MoE gate uses no random token selection and, at top-2,
no sampling of the second expert, in both frameworks (the same work per step). Ratios printed: MoE / dense
step time (the issue's target: at most 1.15 at top-1) and Slipstream / DeepSpeed.
The worker imports only the framework of its row: this file runs in both environments.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parent.parent

SIZES = {  # vocab, d_model, heads, expert ffn, layers, seq, micro batch, experts, ep
    "small": (512, 128, 4, 256, 2, 64, 8, 8, 2),
    "medium": (1024, 256, 4, 1024, 2, 128, 8, 8, 2),
    "large": (2048, 512, 8, 2048, 2, 128, 8, 8, 2),
}
VOCAB, D_MODEL, HEADS, FFN, LAYERS, SEQ, MICRO, EXPERTS, EP = SIZES["small"]


def use_size(name: str) -> None:
    global VOCAB, D_MODEL, HEADS, FFN, LAYERS, SEQ, MICRO, EXPERTS, EP
    VOCAB, D_MODEL, HEADS, FFN, LAYERS, SEQ, MICRO, EXPERTS, EP = SIZES[name]


def build(framework: str, *, moe: bool, k: int):  # type: ignore[no-untyped-def]
    import torch
    from torch import nn

    if framework == "deepspeed":
        from deepspeed.moe.layer import MoE
    else:
        from slipstream.moe.layer import MoE

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
            self.attn = nn.MultiheadAttention(D_MODEL, HEADS, batch_first=True)
            width = FFN if moe else FFN * k
            mlp = nn.Sequential(nn.Linear(D_MODEL, width), nn.GELU(), nn.Linear(width, D_MODEL))
            if moe:
                self.ffn = MoE(
                    D_MODEL,
                    mlp,
                    num_experts=EXPERTS,
                    ep_size=EP,
                    k=k,
                    capacity_factor=1.25,
                    min_capacity=4,
                    use_rts=False,
                    top2_2nd_expert_sampling=False,
                )
            else:
                self.ffn = mlp

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = self.ln1(x)
            x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
            out = self.ffn(self.ln2(x))
            if isinstance(out, tuple):
                return x + out[0], out[1]
            return x + out, torch.zeros((), device=x.device)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(VOCAB, D_MODEL)
            self.pos = nn.Parameter(torch.zeros(SEQ, D_MODEL))
            self.blocks = nn.ModuleList([Block() for _ in range(LAYERS)])
            self.head = nn.Linear(D_MODEL, VOCAB)
            self.register_buffer("mask", torch.triu(torch.full((SEQ, SEQ), float("-inf")), diagonal=1))

        def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            x = self.emb(tokens) + self.pos
            aux = torch.zeros(())
            for block in self.blocks:
                x, l_aux = block(x, self.mask)
                aux = aux + l_aux
            logits = self.head(x)
            return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)) + 0.01 * aux

    torch.manual_seed(0)
    return Model()


def config() -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.01}},
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e7, "allgather_bucket_size": 5e7},
        "steps_per_print": 1_000_000,
    }


def worker(args: argparse.Namespace) -> None:
    import logging

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world = args.rank, 2
    store = dist.FileStore(args.store, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    framework = "deepspeed" if args.row.startswith("deepspeed") else "slipstream"
    if framework == "deepspeed":
        import deepspeed as ds

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    else:
        import slipstream as ds
    model = build(framework, moe=args.row.endswith("moe"), k=args.k)
    engine, _, _, _ = ds.initialize(model=model, model_parameters=model.parameters(), config=config())
    generator = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=generator) for _ in range(4)]
    times, cpu, losses = [], [], []
    for step in range(args.warmup + args.steps):
        batch = batches[step % len(batches)]
        dist.barrier()
        started, started_cpu = time.perf_counter(), time.process_time()
        loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        engine.step()
        elapsed, elapsed_cpu = time.perf_counter() - started, time.process_time() - started_cpu
        if step >= args.warmup:
            times.append(elapsed)
            cpu.append(elapsed_cpu)
            losses.append(float(loss))
    slowest = torch.tensor([times, cpu], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if rank == 0:
        median = statistics.median(slowest[0].tolist())
        result = {
            "step_s": median,
            "cpu_s": statistics.median(slowest[1].tolist()),
            "tokens_per_s": world * MICRO * SEQ / median,
            "rss_mib": peak,
            "loss": statistics.mean(losses),
        }
        print("RESULT " + json.dumps(result), flush=True)
    else:
        print("RSS " + json.dumps({"rss_mib": peak}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def run_row(python: str, row: str, k: int, args: argparse.Namespace) -> dict | None:
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2"}
        procs = [
            subprocess.Popen(
                [
                    python,
                    __file__,
                    "--worker",
                    "--row",
                    row,
                    "--k",
                    str(k),
                    "--rank",
                    str(r),
                    "--store",
                    store,
                    "--steps",
                    str(args.steps),
                    "--warmup",
                    str(args.warmup),
                    "--size",
                    args.size,
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            )
            for r in range(2)
        ]
        outs = [p.communicate(timeout=1800) for p in procs]
    result, rss = None, []
    for (out, err), proc in zip(outs, procs):
        if proc.returncode != 0:
            print(f"  {row} top-{k}: rank failed\n{err[-2000:]}", file=sys.stderr)
            return None
        for line in out.splitlines():
            if line.startswith("RESULT "):
                result = json.loads(line[7:])
                rss.append(result["rss_mib"])
            elif line.startswith("RSS "):
                rss.append(json.loads(line[4:])["rss_mib"])
    if result is not None:
        result["rss_mib"] = max(rss)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--row", default="slipstream-moe", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--store", default="", help=argparse.SUPPRESS)
    parser.add_argument("--k", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--size", choices=sorted(SIZES), default="small", help="model size (see above)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3, help="fresh groups per row, interleaved; medians reported")
    parser.add_argument("--quick", action="store_true", help="3 timed steps after 1 warmup step, one round")
    parser.add_argument("--peer-python", default=str(ROOT / ".bench-venv" / "bin" / "python"))
    args = parser.parse_args()
    use_size(args.size)
    if args.worker:
        worker(args)
        return
    if args.quick:
        args.steps, args.warmup, args.rounds = 3, 1, 1
    peer = args.peer_python if Path(args.peer_python).exists() else None
    print(
        f"MoE transformer ({args.size}): {LAYERS} layers x d{D_MODEL}, {EXPERTS} experts (ffn {FFN}), ep {EP}, seq {SEQ}, "
        f"micro {MICRO}; 2 ranks, ZeRO-2; median of {args.steps} steps after {args.warmup}, {args.rounds} rounds"
    )
    if peer is None:
        print(f"(no peer environment at {args.peer_python}: DeepSpeed rows skipped; bash bench/make_peer_venv.sh)")
    rows = [("slipstream-dense", sys.executable), ("slipstream-moe", sys.executable), ("deepspeed-moe", peer)]
    results: dict[tuple[str, int], list[dict]] = {}
    for round_number in range(args.rounds):  # rounds interleave the rows: load drift hits each alike
        for k in (1, 2):
            for row, python in rows:
                if python is None:
                    continue
                result = run_row(python, row, k, args)
                if result is not None:
                    results.setdefault((row, k), []).append(result)
        print(f"round {round_number + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    print(f"{'row':<18}{'k':>3}{'step ms':>10}{'CPU ms':>9}{'tokens/s':>11}{'peak RSS MiB':>14}{'loss':>9}")
    summary: dict[tuple[str, int], dict] = {}
    for k in (1, 2):
        for row, _ in rows:
            runs = results.get((row, k))
            if not runs:
                continue
            merged = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
            merged["rss_mib"] = max(r["rss_mib"] for r in runs)
            summary[(row, k)] = merged
            print(
                f"{row:<18}{k:>3}{merged['step_s'] * 1e3:>10.1f}{merged['cpu_s'] * 1e3:>9.1f}"
                f"{merged['tokens_per_s']:>11.0f}{merged['rss_mib']:>14.0f}{merged['loss']:>9.4f}"
            )
    for k in (1, 2):
        ours, dense = summary.get(("slipstream-moe", k)), summary.get(("slipstream-dense", k))
        theirs = summary.get(("deepspeed-moe", k))
        for label, a, b in (
            ("Slipstream MoE / dense", ours, dense),
            ("Slipstream MoE / DeepSpeed MoE", ours, theirs),
            ("DeepSpeed MoE / dense", theirs, dense),
        ):
            if a and b:
                print(f"  top-{k}: {label}: step {a['step_s'] / b['step_s']:.2f}x, CPU {a['cpu_s'] / b['cpu_s']:.2f}x")
    print("  (targets: Slipstream MoE / dense <= 1.15x at top-1; Slipstream ahead of DeepSpeed at both)")


if __name__ == "__main__":
    main()

"""ZenFlow in Slipstream against DeepSpeed's own ZenFlow (the peer environment, bench/make_peer_venv.sh).

    python bench/zenflow_peer.py [--peer-python .bench-venv/bin/python] [--steps 12] [--world 1] [--stage 2]
                                 [--compensate]     (ZENFLOW_PEER_SECTION='{...}' replaces the zenflow section)

Trains the same small MLP from the same initial weights on the same batches with the same
`zero_optimization.zenflow` section (CPU offload, overlap_step false) in both libraries, then prints the largest
difference of the final parameters, and, for each side, whether `initialize` left the 2-D weights as they were.
Reports, asserts nothing. The same file is the worker of each side (`--side`), each in its own interpreter.

Found with DeepSpeed 0.19.8 (torch 2.13, CPU accelerator, gloo; ZeRO 1 and 2, 1 and 2 ranks, fp32 and bf16): its
ZenFlow `initialize` leaves every 2-D weight holding its transpose's memory (`w == w0.t().contiguous().view(w0.shape)`:
its flat buffers lay 2-D weights out transposed), and the weights keep diverging afterwards even when
`--compensate` hands it pre-arranged weights and the warm-up covers every step (plain CPU Adam steps): the final
parameters differ by about as much as training moved them. So its numbers are not a reference here; Slipstream's
ZenFlow is checked against a plain single-process ZenFlow instead (tests/dist/zero/test_zenflow.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

ZENFLOW = json.loads(os.environ.get("ZENFLOW_PEER_SECTION", "null")) or {
    "topk_ratio": 0.3, "select_strategy": "step", "select_interval": 6, "update_interval": 3,
    "full_warm_up_rounds": 0, "overlap_step": False}


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        dims = [13, 37, 37, 5]
        self.layers = torch.nn.ModuleList()
        for a, b in zip(dims[:-1], dims[1:]):
            layer = torch.nn.Linear(a, b)
            with torch.no_grad():
                layer.weight.copy_(torch.randn(b, a, generator=gen) / math.sqrt(a))
                layer.bias.copy_(torch.randn(b, generator=gen) * 0.1)
            self.layers.append(layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            x = torch.tanh(x) if i < len(self.layers) - 1 else x
        return x


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(8, 13, generator=torch.Generator().manual_seed(500 + step))
    teacher = torch.randn(13, 5, generator=torch.Generator().manual_seed(1234))
    return x, torch.tanh(x @ teacher / math.sqrt(13))


def _rank(rank: int, world: int, side: str, store: str, config: dict, steps: int, out: str) -> None:
    env = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": world}
    os.environ.update({k: str(v) for k, v in env.items()}, DS_ACCELERATOR="cpu")
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    if side == "deepspeed":
        import deepspeed as library

        library.init_distributed(dist_backend="gloo")
    else:
        import slipstream as library
    model = MLP()
    if side == "deepspeed" and os.environ.get("ZENFLOW_PEER_COMPENSATE") == "1":
        # hand DeepSpeed the column-major reading of each weight, so that its initialize (which reads each
        # 2-D weight's memory as its transpose, see the check in main) starts from the intended values
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() == 2:
                    rows, cols = param.shape
                    param.copy_(param.detach().reshape(-1).view(cols, rows).t().clone())
    engine, *_ = library.initialize(model=model, model_parameters=model.parameters(), config=config)
    initial = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    per_rank = 8 // world
    for step in range(steps):
        x, y = batch(step)
        x, y = x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    if rank == 0:
        final = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
        torch.save({"initial": initial, "final": final}, out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _worker(args: argparse.Namespace) -> None:
    config = {"train_micro_batch_size_per_gpu": 8 // args.world,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
              "zero_optimization": {"stage": args.stage, "offload_optimizer": {"device": "cpu"}, "zenflow": ZENFLOW}}
    store = args.out + ".store"
    mp.start_processes(_rank, args=(args.world, args.side, store, config, args.steps, args.out), nprocs=args.world,
                       start_method="spawn")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peer-python", default=str(Path(__file__).resolve().parents[1] / ".bench-venv/bin/python"))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--side", choices=["deepspeed", "slipstream"])
    parser.add_argument("--out")
    parser.add_argument("--compensate", action="store_true",
                        help="give DeepSpeed weights pre-arranged so that its initialize yields the intended ones")
    args = parser.parse_args()
    if args.side:
        _worker(args)
        return
    if not Path(args.peer_python).exists():
        print(f"no DeepSpeed peer environment at {args.peer_python} (bench/make_peer_venv.sh creates it)")
        return
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for side, python in (("deepspeed", args.peer_python), ("slipstream", sys.executable)):
            out = os.path.join(tmp, f"{side}.pt")
            command = [python, __file__, "--side", side, "--out", out, "--steps", str(args.steps),
                       "--world", str(args.world), "--stage", str(args.stage)]
            env = dict(os.environ, ZENFLOW_PEER_COMPENSATE="1" if args.compensate else "0")
            subprocess.run(command, check=True, capture_output=True, env=env)
            results[side] = torch.load(out)
    model = {n: p.detach() for n, p in MLP().named_parameters()}
    ds, ours = results["deepspeed"], results["slipstream"]
    print(f"ZenFlow {json.dumps(ZENFLOW)}, ZeRO {args.stage}, {args.world} rank(s), {args.steps} steps")
    for side, result in results.items():
        kept = all(torch.equal(result["initial"][n], model[n]) for n in model)
        transposed = all(
            torch.equal(result["initial"][n], model[n].t().contiguous().view(model[n].shape))
            for n in model if model[n].dim() == 2
        )
        print(f"  {side}: initial weights kept after initialize: {kept}; 2-D weights hold their transpose's "
              f"memory: {transposed}")
    for name in model:
        diff = float((ds["final"][name] - ours["final"][name]).abs().max())
        moved = float((ours["final"][name] - model[name]).abs().max())
        print(f"  {name}: max |deepspeed - slipstream| {diff:.2e} (slipstream moved it by {moved:.2e})")


if __name__ == "__main__":
    main()

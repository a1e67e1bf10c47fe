"""The training job that test_multinode_ssh.py launches on every node: a tiny MLP trained with ZeRO-2.

    slipstream run --hostfile H ... tests/launcher/multinode_job.py --deepspeed_config ds.json --steps 4

Each rank trains on its own seeded batches (so the gradients differ and only a working all-reduce keeps
the ranks' parameters equal), then prints one line the test parses:

    RESULT rank=R world_size=W local_rank=L local_rank_arg=L master=ADDR:PORT final_loss=F checksum=HEX

`--fail_rank R` makes the process with RANK=R raise: with `--fail_at step` after its first step (the
other ranks then fail in the next step's collectives), with `--fail_at init` before joining the process
group (the other ranks then wait there, silently, until the launcher stops them). `--tag` is not read;
the test puts a unique value there to find the job's processes in the process table.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root, for `tests.harness`

import slipstream
from tests.harness.models import TinyMLP


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--fail_rank", type=int, default=-1, help="the rank that raises on purpose")
    parser.add_argument("--fail_at", choices=("init", "step"), default="step", help="when --fail_rank raises")
    parser.add_argument("--tag", default="", help="ignored; marks the job's processes for the test")
    slipstream.add_config_arguments(parser)
    return parser.parse_args()


def checksum(model: torch.nn.Module) -> str:
    """A hash of every parameter's bytes: equal on two ranks only if their parameters are bit-identical."""
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters()):
        digest.update(name.encode())
        digest.update(bytes(param.detach().float().contiguous().view(torch.uint8).flatten().tolist()))
    return digest.hexdigest()[:16]


def main() -> int:
    args = parse_args()
    if args.fail_at == "init" and int(os.environ.get("RANK", "-1")) == args.fail_rank:
        raise RuntimeError(f"multinode_job: rank {args.fail_rank} fails on purpose before init (--fail_rank)")
    engine, *_ = slipstream.initialize(args=args, model=TinyMLP())
    rank = engine.global_rank
    loss = torch.tensor(float("nan"))
    for step in range(args.steps):
        inputs, targets = engine.module.make_batch(seed=1000 * step + rank, batch_size=4)
        loss = TinyMLP.loss(engine(inputs), targets)
        engine.backward(loss)
        engine.step()
        if rank == args.fail_rank and args.fail_at == "step":
            raise RuntimeError(f"multinode_job: rank {rank} fails on purpose after step {step} (--fail_rank)")
    master = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    line = (
        f"RESULT rank={rank} world_size={engine.world_size} local_rank={os.environ.get('LOCAL_RANK')} "
        f"local_rank_arg={args.local_rank} master={master} final_loss={loss.item():.6f} "
        f"checksum={checksum(engine.module)}\n"
    )
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), line.encode())  # one write: lines of ranks sharing a pipe do not interleave
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A 2-rank job for `slipstream run` in which rank 1 fails one way at step 3 while rank 0 keeps training.

`fault_job.py --stage {2,3} --fault {sigstop,sigkill,save} --timeout T --out DIR TAG`: trains a tiny model with
"collective_timeout": T; at step 3 rank 1 prints `FAULT <time.time()>` and then stops itself (SIGSTOP), kills
itself (SIGKILL), or calls save_checkpoint alone (the other rank goes on training). Each rank prints its pid
first. TAG only marks the processes, so a test can find any that outlive the job.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import torch

import slipstream

STEPS = 2000  # rank 0 trains until the job is torn down; this only bounds a job whose fault went unnoticed


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--fault", choices=("sigstop", "sigkill", "save"), required=True)
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("tag")
    args = parser.parse_args()
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": args.stage}, "collective_timeout": args.timeout}
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    engine, *_ = slipstream.initialize(model=model, config=config)
    rank = engine.global_rank
    print(f"rank {rank} pid {os.getpid()}", flush=True)
    for step in range(STEPS):
        if rank == 1 and step == 3:
            print(f"FAULT {time.time():.3f}", flush=True)
            if args.fault == "save":
                engine.save_checkpoint(args.out, tag="lonely")
                return 0
            os.kill(os.getpid(), signal.SIGSTOP if args.fault == "sigstop" else signal.SIGKILL)
        loss = engine(torch.ones(2, 8)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    return 0


if __name__ == "__main__":
    sys.exit(main())

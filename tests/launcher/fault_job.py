"""A 2-rank job for `slipstream run` in which rank 1 fails one way at step 3 while rank 0 keeps training.

`fault_job.py --stage {2,3} --fault F --timeout T --out DIR TAG`: trains a tiny model with "collective_timeout":
T (for the GATHER_FAULTS at ZeRO-3 the forward gathers every parameter); at step 3 rank 1 prints
`FAULT <time.time()>` and then, by F:
- sigstop / sigkill / sigterm: stops itself (SIGSTOP), kills itself (SIGKILL), or is terminated (SIGTERM, as an
  OOM killer or a scheduler would send it, not the agent) while rank 0 trains on;
- save: calls save_checkpoint alone (the other rank goes on training);
- stop_in_gather: stops itself (SIGSTOP) right after recording its arrival at the next ZeRO-3 parameter
  all-gather of the forward, so every rank arrived at that collective and it cannot complete.
Each rank prints its pid first. TAG only marks the processes, so a test can find any that outlive the job.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import torch

import slipstream
from slipstream.comm import arrivals

STEPS = 2000  # rank 0 trains until the job is torn down; this only bounds a job whose fault went unnoticed
SIGNALS = {"sigstop": signal.SIGSTOP, "sigkill": signal.SIGKILL, "sigterm": signal.SIGTERM}
GATHER_FAULTS = ("sigterm", "stop_in_gather")


def signal_on_arrival(sig: signal.Signals, where: str) -> None:
    """Send `sig` to this process once it has recorded its arrival at a collective issued from `where`."""
    record = arrivals.record

    def recorded(identity: str) -> int:
        seq = record(identity)
        if where in identity:
            os.kill(os.getpid(), sig)
        return seq

    arrivals.record = recorded  # type: ignore[assignment]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--fault", choices=(*SIGNALS, "save", "stop_in_gather"), required=True)
    parser.add_argument("--timeout", type=float, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("tag")
    args = parser.parse_args()
    zero: dict[str, int] = {"stage": args.stage}
    if args.fault in GATHER_FAULTS:  # the forward gathers every parameter (none stays gathered as persistent)
        zero["stage3_param_persistence_threshold"] = 0
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "zero_optimization": zero, "collective_timeout": args.timeout}
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
            if args.fault == "stop_in_gather":
                signal_on_arrival(signal.SIGSTOP, "(start_gather)")
            else:
                os.kill(os.getpid(), SIGNALS[args.fault])
        loss = engine(torch.ones(2, 8)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    return 0


if __name__ == "__main__":
    sys.exit(main())

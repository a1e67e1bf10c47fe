"""The training script of bench/autotune.py, for both frameworks: a 4-layer MLP (width 512) on random data.

    _autotune_job.py --deepspeed_config PATH [--peer] [--steps N]

`--peer` imports DeepSpeed (run by .bench-venv's python under DeepSpeed's autotuner); otherwise Slipstream.
A profiled trial ends itself after `autotuning.end_profile_step`.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed_config", required=True)
    parser.add_argument("--peer", action="store_true")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()
    if args.peer:
        import deepspeed
    else:
        import slipstream as deepspeed
    torch.manual_seed(0)
    width = 512
    model = nn.Sequential(*[layer for _ in range(4) for layer in (nn.Linear(width, width), nn.GELU())])
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=args.deepspeed_config)
    micro = engine.train_micro_batch_size_per_gpu()
    for step in range(args.steps * engine.gradient_accumulation_steps()):
        inputs = torch.randn(micro, width, generator=torch.Generator().manual_seed(step))
        loss = engine(inputs).pow(2).mean()
        engine.backward(loss)
        engine.step()


if __name__ == "__main__":
    main()

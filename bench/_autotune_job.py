"""The training script of bench/autotune.py, for both frameworks: the example GPT (examples/gpt/model.py, 4 layers,
width 256, 4 heads, sequences of 64 tokens) on random tokens.

    _autotune_job.py --deepspeed_config PATH [--peer] [--steps N]

`--peer` imports DeepSpeed (run by .bench-venv's python under DeepSpeed's autotuner); otherwise Slipstream.
A profiled trial ends itself after `autotuning.end_profile_step`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "gpt"))

import torch
from model import GPT, GPTConfig

SEQ = 64


def bench_model() -> GPT:
    """The benchmark's model (also built by bench/autotune.py for the planner's figures)."""
    return GPT(GPTConfig(vocab_size=96, block_size=SEQ, n_layer=4, n_head=4, n_embd=256))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed_config", required=True)
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--peer", action="store_true", help="train with DeepSpeed (its autotuner's run)")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    if args.peer:
        import deepspeed
    else:
        import slipstream as deepspeed
    torch.manual_seed(0)
    model = bench_model()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=args.deepspeed_config)
    micro = engine.train_micro_batch_size_per_gpu()
    for step in range(args.steps * engine.gradient_accumulation_steps()):
        tokens = torch.randint(0, 96, (micro, SEQ + 1), generator=torch.Generator().manual_seed(step))
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()


if __name__ == "__main__":
    main()

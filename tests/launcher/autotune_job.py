"""A tiny training script for the tuner's tests: `autotune_job.py --deepspeed_config PATH [--out FILE] [--steps N]
[--fail_stage S]`.

It trains the harness's TinyMLP for N optimizer steps (default 50: a profiled trial ends itself at
end_profile_step) and, with --out, writes the launched job's view of its config on rank 0: the config file it was
given and what the engine resolved from it (stage, micro batch, accumulation, offload).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import slipstream
from tests.harness.models import TinyMLP


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepspeed_config", required=True)
    parser.add_argument("--out", default="")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--local_rank", type=int, default=0)
    parser.add_argument("--batch", type=int, default=0, help="set by arg_mappings in a test")
    parser.add_argument("--fail_stage", type=int, default=-1, help="raise at this ZeRO stage (a failing trial)")
    args = parser.parse_args()
    model = TinyMLP()
    engine, *_ = slipstream.initialize(model=model, config=args.deepspeed_config)
    plan = engine.plan
    if plan.zero.stage == args.fail_stage:
        raise RuntimeError(f"autotune_job: told to fail at ZeRO stage {args.fail_stage}")
    if args.out and engine.global_rank == 0:
        view = {
            "config_file": json.loads(Path(args.deepspeed_config).read_text()),
            "stage": plan.zero.stage,
            "micro_batch": plan.batch.micro_batch_size,
            "grad_accum": plan.batch.gradient_accumulation_steps,
            "offload": type(plan.zero.offload_optimizer).__name__,
            "batch_arg": args.batch,
            "profiled": plan.autotuning.enabled,
        }
        Path(args.out).write_text(json.dumps(view))
    micro = plan.batch.micro_batch_size
    for step in range(args.steps * plan.batch.gradient_accumulation_steps):
        inputs, targets = model.make_batch(seed=step, batch_size=micro)
        engine.backward(TinyMLP.loss(engine(inputs), targets))
        engine.step()
    engine.destroy()


if __name__ == "__main__":
    main()

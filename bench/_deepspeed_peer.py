"""DeepSpeed's side of bench/zero_step.py; runs only in the peer environment (.bench-venv), never imported.

    .bench-venv/bin/python bench/_deepspeed_peer.py --stage 2 --spec '{"steps": 30, ...}'

Owns the DeepSpeed runs: it spawns the ranks with the shared `_zero_common.spawn_run` (same model, data,
timing and memory figures as the Slipstream and DDP runs), builds `deepspeed.initialize` with the same JSON
config, and prints the result as one JSON line on stdout. Slipstream never imports this file or deepspeed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
BENCH_DIR = Path(__file__).resolve().parent
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))

import torch  # noqa: E402

from _zero_common import BenchSpec, build_model, ds_config, make_batches, rss_mib, spawn_run, summarise, timed_loop  # noqa: E402,E501


def deepspeed_worker(rank: int, spec: BenchSpec, *, stage: int) -> dict[str, Any] | None:
    import logging

    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    vocab_size, batches = make_batches(spec, rank)
    model = build_model(spec, vocab_size)
    rss_before = rss_mib()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config(spec, stage=stage))

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = engine(inputs, targets)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    times, losses = timed_loop(step, batches)
    result = summarise(spec, times=times, losses=losses, owned_bytes=None, rss_before_mib=rss_before,
                     num_params=model.num_parameters())
    if result is not None:
        result["optimizer"] = type(engine.optimizer).__name__
        result["basic_optimizer"] = type(engine.basic_optimizer).__name__
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, required=True, choices=(0, 1, 2))
    parser.add_argument("--spec", required=True, help="BenchSpec as JSON")
    args = parser.parse_args()
    result = spawn_run(deepspeed_worker, BenchSpec.from_json(args.spec), stage=args.stage)
    result["deepspeed_version"] = __import__("deepspeed").__version__
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The Transformers `Trainer` on Slipstream and on DeepSpeed: time to first step and samples/s.

    python bench/trainer.py [--quick] [--rounds 2] [--steps 12] [--peer-python .bench-venv/bin/python]

Owns the Trainer comparison table. The same script, the same Trainer run (a GPT-2 built from a config: 4 layers
x 256, vocabulary 2048, 128 tokens, about 3.7M parameters, fp32; micro batch 2 per rank, gradient accumulation 2,
2 ranks on gloo, one thread each), is started twice per configuration: with this environment's Python, where
`import deepspeed` is Slipstream (the installed compat distribution, or tests/compat_hf/shim), and with the peer
environment's Python (.bench-venv: DeepSpeed 0.19.8, Transformers and Accelerate; bench/make_peer_venv.sh).
Configurations: ZeRO-2 + optimizer offload to the CPU, and ZeRO-3. Figures per run (rank 0):
    time to first step: from the launch of the rank processes (interpreter start, imports, Trainer, engine,
                        the first optimizer step);
    samples/s:          global samples of the steps after the first two, over their wall time.
Runs alternate between the frameworks, round after round; a warm-up round (first JIT builds, file caches) is
dropped and the median of the other rounds is reported with the ratio DeepSpeed / Slipstream (above 1: Slipstream
is faster). Target (reported, not asserted): Slipstream faster on both figures in both configurations.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ("zero2_offload", "zero3")
MARK = "BENCH-TRAINER "


def ds_config(name: str) -> dict[str, Any]:
    zero: dict[str, Any] = (
        {"stage": 2, "offload_optimizer": {"device": "cpu"}}
        if name == "zero2_offload"
        else {"stage": 3, "stage3_param_persistence_threshold": 0}
    )
    return {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": zero,
        "steps_per_print": 1000000,
    }


def rank_main(config: str, steps: int, out: str) -> None:
    """One rank of one run (started by `main` with RANK, WORLD_SIZE, MASTER_ADDR/PORT, BENCH_T0 set)."""
    import torch

    torch.set_num_threads(1)
    framework = "deepspeed"
    if os.environ.get("BENCH_SLIPSTREAM") == "1":
        sys.path.insert(0, str(ROOT))
        from tests.compat_hf import hf_common

        hf_common.use_slipstream_as_deepspeed()
        framework = "slipstream"
    import deepspeed  # noqa: F401 - imported here so its import time counts the same in both environments
    from accelerate.state import PartialState
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    PartialState(backend="gloo")  # Accelerate finds no backend for DeepSpeed on CPU by itself
    world = int(os.environ["WORLD_SIZE"])
    micro, gas = 2, 2
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=gas,
        max_steps=steps,
        learning_rate=1e-3,
        seed=0,
        report_to=[],
        save_strategy="no",
        logging_steps=1000,
        disable_tqdm=True,
        dataloader_pin_memory=False,
        accelerator_config={"use_configured_state": True},
        deepspeed=ds_config(config),
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=2048, n_positions=128, n_embd=256, n_layer=4, n_head=4))
    ids = torch.randint(0, 2048, (steps * micro * gas * world, 128), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "labels": row} for row in ids]
    stamps: list[float] = []

    class Stamp(TrainerCallback):
        def on_step_end(self, *a: Any, **k: Any) -> None:
            stamps.append(time.time())

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[Stamp()])
    trainer.train()
    if int(os.environ["RANK"]) == 0:
        t0 = float(os.environ["BENCH_T0"])
        skip = 2
        rate = (len(stamps) - 1 - skip) * micro * gas * world / (stamps[-1] - stamps[skip])
        print(
            MARK
            + json.dumps(
                {
                    "framework": framework,
                    "config": config,
                    "first_step_s": stamps[0] - t0,
                    "samples_per_s": rate,
                    "steps": len(stamps),
                }
            ),
            flush=True,
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_once(python: str, *, slipstream: bool, config: str, steps: int, timeout_s: float) -> dict[str, Any] | None:
    port, procs = _free_port(), []
    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as out:
        t0 = time.time()
        for rank in range(2):
            env = {
                **os.environ,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": "2",
                "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "ACCELERATE_USE_DEEPSPEED": "true",
                "OMP_NUM_THREADS": "1",
                "HF_HUB_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false",
                "BENCH_T0": repr(t0),
                "BENCH_SLIPSTREAM": "1" if slipstream else "0",
                "DS_BUILD_OPS": "0",
            }
            procs.append(
                subprocess.Popen(
                    [python, __file__, "--rank", config, str(steps), out],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    cwd=ROOT,
                )
            )
        outputs = []
        for p in procs:
            try:
                outputs.append(p.communicate(timeout=timeout_s)[0])
            except subprocess.TimeoutExpired:
                p.kill()
                outputs.append(p.communicate()[0])
    for line in outputs[0].splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK) :])
    tail = "\n".join(o[-3000:] for o in outputs)
    print(f"run failed ({'slipstream' if slipstream else 'deepspeed'}, {config}):\n{tail}", file=sys.stderr)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", nargs=3, metavar=("CONFIG", "STEPS", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="one measured round of 6 steps")
    parser.add_argument("--rounds", type=int, default=2, help="measured rounds (after one warm-up round)")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    parser.add_argument("--peer-python", default=str(ROOT / ".bench-venv" / "bin" / "python"))
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args()
    if args.rank:
        rank_main(args.rank[0], int(args.rank[1]), args.rank[2])
        return
    rounds, steps = (1, 6) if args.quick else (args.rounds, args.steps)
    frameworks = [("slipstream", sys.executable, True)]
    peer_ok = (
        Path(args.peer_python).exists()
        and subprocess.run(
            [args.peer_python, "-c", "import deepspeed, transformers, accelerate"], capture_output=True
        ).returncode
        == 0
    )
    if peer_ok:
        frameworks.append(("deepspeed", args.peer_python, False))
    else:
        print(
            f"no peer environment with deepspeed + transformers at {args.peer_python}: Slipstream rows only "
            "(bash bench/make_peer_venv.sh installs them)"
        )
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    started = time.time()
    for round_ in range(rounds + 1):
        for config in CONFIGS:
            for name, python, ours in frameworks:
                result = run_once(python, slipstream=ours, config=config, steps=steps, timeout_s=args.timeout)
                if result is not None and round_ > 0:
                    results.setdefault((name, config), []).append(result)
                print(
                    f"round {round_}{' (warm-up, dropped)' if round_ == 0 else ''} {name:10s} {config:14s} "
                    + (
                        "failed"
                        if result is None
                        else f"first step {result['first_step_s']:.1f} s, {result['samples_per_s']:.2f} samples/s"
                    ),
                    flush=True,
                )

    def median(name: str, config: str, key: str) -> float | None:
        rows = results.get((name, config))
        return statistics.median(r[key] for r in rows) if rows else None

    print(
        f"\nTrainer, GPT-2 3.7M, fp32, 2 ranks x micro 2 x accumulation 2, {steps} steps, median of {rounds} "
        f"round(s); {time.time() - started:.0f} s in all"
    )
    print(
        f"{'config':14s} | {'first step s: slipstream':>24s} | {'deepspeed':>9s} | {'ratio':>5s} || "
        f"{'samples/s: slipstream':>21s} | {'deepspeed':>9s} | {'ratio':>5s}"
    )
    for config in CONFIGS:
        ours_t, peer_t = median("slipstream", config, "first_step_s"), median("deepspeed", config, "first_step_s")
        ours_r, peer_r = median("slipstream", config, "samples_per_s"), median("deepspeed", config, "samples_per_s")

        def fmt(v: float | None) -> str:
            return "-" if v is None else f"{v:.2f}"

        ratio_t = fmt(peer_t / ours_t) if ours_t and peer_t else "-"
        ratio_r = fmt(ours_r / peer_r) if ours_r and peer_r else "-"
        print(
            f"{config:14s} | {fmt(ours_t):>24s} | {fmt(peer_t):>9s} | {ratio_t:>5s} || {fmt(ours_r):>21s} | "
            f"{fmt(peer_r):>9s} | {ratio_r:>5s}"
        )
    print(
        "ratios: above 1 means Slipstream is faster (DeepSpeed time / Slipstream time; Slipstream rate / "
        "DeepSpeed rate)"
    )


if __name__ == "__main__":
    main()

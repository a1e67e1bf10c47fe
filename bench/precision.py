"""Precision options side by side: step time and held bytes at ZeRO 2 and 3 (2 ranks, gloo), against DeepSpeed.

    python bench/precision.py [--quick] [--layers 8] [--width 1024] [--steps 6] [--rounds 1] [--stages 2,3]
                              [--rows fp32,bf16,autocast,bf16_masters] [--peer-python .bench-venv/bin/python]
                              [--loss-steps 300] [--loss-only]

Rows: `fp32` (fp32 parameters and masters), `bf16` (bf16 parameters, fp32 masters), `autocast`
(`torch_autocast` bf16: fp32 parameters, bf16 compute), `bf16_masters` (`bf16_master_weights_and_grads` +
`bf16_optimizer_states`: no fp32 copy, bf16 Adam moments). The model is a stack of Linear(width, width) + ReLU
layers trained with AdamW (bench/_precision_rows.py). Per row: the median step time over `--steps` steps after
two warm-up steps (with `--rounds N`, every row is timed N times, the rounds interleaved, and the median of
the rounds is shown beside each round's); `cpu ms`, the median CPU time of rank 0's process per step (all its
threads: less sensitive than the step time to other work on a shared machine); `states MiB`, the model-state bytes Slipstream's engine holds per rank (parameters or their
shard, masters, gradients, optimizer state: `engine.optimizer.owned_bytes()` plus the optimizer's state
tensors); `live MiB`, the bytes of every tensor alive on rank 0 after the last step less those before the
engine was built, counted the same way for DeepSpeed. With `.bench-venv` present (`--peer-python`), DeepSpeed
0.19.8 runs the same configs (bench/_precision_peer.py) in another pair of ranks; the ratios are to the fp32
row of the same library and stage, and `vs DS` is Slipstream's step time over DeepSpeed's for the same row.

`--loss-steps N` (slow: four single-process runs of examples/gpt/train.py at ZeRO-2) trains the example GPT for
N steps in fp32 and with bf16 masters + bf16 optimizer states, with the example's gradient clipping and with
clipping off, and prints the mean loss of each run's last 50 steps and their difference (the target: within 2%);
`--loss-only` skips the table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from _precision_rows import ROWS, time_row
from _two_ranks import run_two_ranks

ROOT = Path(__file__).resolve().parent.parent


def model_state_bytes(engine: object) -> int:
    zero = engine.optimizer  # type: ignore[attr-defined]
    owned = zero.owned_bytes()
    states = sum(
        t.numel() * t.element_size()
        for s in zero.optimizer.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )
    return sum(owned.get(k, 0) for k in ("params", "master", "grads", "offloaded_params")) + states


def measure(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Every row at every stage, one after the other, on this rank (bench/_two_ranks.py runs it on both)."""
    import slipstream

    states: dict[str, float] = {}

    def initialize(**kwargs: object) -> tuple:
        kwargs.pop("model_parameters")
        engine, *rest = slipstream.initialize(**kwargs)  # type: ignore[arg-type]
        states["bytes"] = float(model_state_bytes(engine))
        return (engine, *rest)

    rounds: dict[str, list[dict]] = {}
    for _ in range(args.rounds):  # interleaved: every row once per round, so slow spells of the machine hit all
        for stage in args.stages:
            for row in args.rows:
                result = time_row(initialize, row, stage, layers=args.layers, width=args.width, steps=args.steps)
                rounds.setdefault(f"{stage}:{row}", []).append({**result, "bytes": states["bytes"]})
    return {key: _median_round(each) for key, each in rounds.items()}


def _median_round(each: list[dict]) -> dict:
    """The last round's values, with the step and CPU times the median over the rounds and each round's listed."""
    times = {key: statistics.median(r[key] for r in each) for key in ("step_s", "cpu_s")}
    return {**each[-1], **times, "rounds_s": [r["step_s"] for r in each]}


def measure_peer(args: argparse.Namespace) -> dict[str, dict]:
    """DeepSpeed's rows from the peer environment; {} when it is absent."""
    if not Path(args.peer_python).exists():
        print(f"(no DeepSpeed rows: {args.peer_python} not found)")
        return {}
    spec = {k: getattr(args, k) for k in ("layers", "width", "steps", "stages", "rows")}
    done = subprocess.run(
        [str(args.peer_python), str(ROOT / "bench" / "_precision_peer.py"), json.dumps(spec)],
        capture_output=True, text=True, cwd=ROOT, timeout=3600,
        env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517", "PYTHONPATH": ""},
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        print(f"(DeepSpeed rows failed: {done.stderr.strip().splitlines()[-1:] or done.returncode})")
        return {}
    return json.loads(lines[-1])


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:.2f}"


def report(ours: dict, peer: dict, args: argparse.Namespace) -> None:
    print(f"precision: {args.layers} x Linear({args.width}, {args.width}), micro batch 16, 2 ranks, gloo")
    print(f"{'stage':>5} {'library':<10} {'row':<13} {'step ms':>8} {'cpu ms':>7} {'states MiB':>10} {'live MiB':>9} "
          f"{'time/fp32':>9} {'live/fp32':>9} {'vs DS':>6}  rounds ms")
    for stage in args.stages:
        for name, results in (("slipstream", ours), ("deepspeed", peer)):
            base = results.get(f"{stage}:fp32", {})
            for row in args.rows:
                r = results.get(f"{stage}:{row}")
                if r is None:
                    continue
                if "error" in r:
                    print(f"{stage:>5} {name:<10} {row:<13} refused: {r['error']}")
                    continue
                t = f"{r['step_s'] / base['step_s']:.2f}x" if "step_s" in base else "-"
                b = f"{r['live'] / base['live']:.2f}x" if "live" in base else "-"
                ds = peer.get(f"{stage}:{row}", {})
                vs = f"{r['step_s'] / ds['step_s']:.2f}x" if name == "slipstream" and "step_s" in ds else ""
                cpu = f"{r['cpu_s'] * 1e3:.1f}" if "cpu_s" in r else "-"
                each = " ".join(f"{s * 1e3:.0f}" for s in r.get("rounds_s", []))
                print(f"{stage:>5} {name:<10} {row:<13} {r['step_s'] * 1e3:>8.1f} {cpu:>7} {_mib(r.get('bytes')):>10} "
                      f"{_mib(r['live']):>9} {t:>9} {b:>9} {vs:>6}  {each}")


LAST_STEPS = 50
"""The loss compared is the mean over the last this many steps (one batch's loss is too noisy to compare)."""


def final_loss(row: str, steps: int, workdir: Path, *, clip: float) -> float:
    """The mean loss of the last LAST_STEPS of `steps` steps of examples/gpt/train.py (one process, ZeRO-2)
    with `row`'s precision and `gradient_clipping` set to `clip` (0: off)."""
    config = json.loads((ROOT / "examples" / "gpt" / "ds_config_zero2.json").read_text())
    config["scheduler"]["params"]["total_num_steps"] = steps
    config["gradient_clipping"] = clip
    config.update(ROWS[row])
    path = workdir / f"{row}_clip{clip}.json"
    path.write_text(json.dumps(config))
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "gpt" / "train.py"), "--deepspeed_config", str(path),
         "--steps", str(steps), "--out_dir", str(workdir / path.stem), "--sample_chars", "1", "--print_every", "1"],
        capture_output=True, text=True, cwd=ROOT, check=True,
    )
    losses = [float(loss) for loss in re.findall(r"step +\d+/\d+ +loss ([0-9.]+)", done.stdout)]
    return sum(losses[-LAST_STEPS:]) / len(losses[-LAST_STEPS:])


LOSS_CLIPS = {"clipping 1.0 (the example's)": 1.0, "clipping off": 0.0}
"""With the example's clipping every late step is clipped and the run is sensitive to rounding (plain PyTorch in
bf16 ends as far from its fp32 run), so the comparison is also made without clipping (docs/precision.md)."""


def loss_comparison(steps: int) -> None:
    for label, clip in LOSS_CLIPS.items():
        with tempfile.TemporaryDirectory() as tmp:
            fp32, low = (final_loss(row, steps, Path(tmp), clip=clip) for row in ("fp32", "bf16_masters"))
        print(f"examples/gpt, {steps} steps at ZeRO-2, {label}, mean loss of the last {LAST_STEPS}: fp32 "
              f"{fp32:.4f}, bf16 masters + states {low:.4f} ({(low - fp32) / fp32:+.2%}; target within 2%)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 small layers, 2 steps: a smoke run")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=1, help="time every row this many times, interleaved")
    parser.add_argument("--stages", default="2,3")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--peer-python", type=Path, default=ROOT / ".bench-venv" / "bin" / "python")
    parser.add_argument("--loss-steps", type=int, default=0, help="also compare final losses of examples/gpt")
    parser.add_argument("--loss-only", action="store_true", help="only the --loss-steps comparison")
    args = parser.parse_args()
    args.stages = [int(s) for s in args.stages.split(",")]
    args.rows = [r for r in args.rows.split(",") if r]
    unknown = sorted(set(args.rows) - set(ROWS))
    if unknown:
        sys.exit(f"--rows: unknown {unknown}; choose from {sorted(ROWS)}")
    if args.quick:
        args.layers, args.width, args.steps = 2, 128, 2
    sys.path.insert(0, str(ROOT))
    if not args.loss_only:
        report(run_two_ranks(measure, args), measure_peer(args), args)
    if args.loss_steps:
        loss_comparison(args.loss_steps)


if __name__ == "__main__":
    main()

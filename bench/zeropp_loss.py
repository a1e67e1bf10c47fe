"""ZeRO++'s loss curve: examples/gpt trained at stage 3 on 2 ranks (the Makefile's `train`, launched the same way)
plain, with qwZ, with qgZ, with both and with qgZ error-compensated by LoCo, the same seed and data; printed: each run's first loss, the mean of its
last `--tail` losses and that mean's ratio to plain's (the bar: within 2%).

    python bench/zeropp_loss.py [--steps 200] [--tail 20] [--work DIR] [--seed 1234] [--only plain,qgZ]

Every run uses examples/gpt/ds_config_zero2.json with stage 3 (persistence threshold 0, so every block is
gathered and reduced through the quantized paths) and the cosine schedule stretched to `--steps`. One machine:
the two ranks are one "node", so qgZ is its int4 exchange inside the node alone.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNS = {
    "plain": {},
    "qwZ": {"zero_quantized_weights": True},
    "qgZ": {"zero_quantized_gradients": True},
    "qwZ+qgZ": {"zero_quantized_weights": True, "zero_quantized_gradients": True},
    "qgZ+LoCo": {"zero_quantized_gradients": True, "zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1024}},
}
LOSS_LINE = re.compile(r"train\.py: step\s+(\d+)/\d+\s+loss\s+([0-9.]+)")


def config(steps: int, zeropp: dict[str, object]) -> dict:
    cfg = json.loads((ROOT / "examples/gpt/ds_config_zero2.json").read_text())
    cfg["zero_optimization"] = {"stage": 3, "stage3_param_persistence_threshold": 0, **zeropp}
    cfg["scheduler"]["params"]["total_num_steps"] = steps
    return cfg


def run(name: str, steps: int, work: Path, seed: int) -> list[float]:
    """The run's `steps` losses; a log of a finished run already in `work` is read instead of training again."""
    path, log = work / f"{name.replace('+', '_')}.json", work / f"{name.replace('+', '_')}.log"
    if log.exists() and len(LOSS_LINE.findall(log.read_text())) == steps:
        return [float(m.group(2)) for m in LOSS_LINE.finditer(log.read_text())]
    path.write_text(json.dumps(config(steps, RUNS[name])))
    command = [
        str(ROOT / ".venv/bin/slipstream"), "run", "--num_gpus", "2", "examples/gpt/train.py",
        "--deepspeed_config", str(path), "--steps", str(steps), "--print_every", "1",
        "--out_dir", str(work / name.replace("+", "_")), "--max_final_ratio", "10", "--sample_chars", "0",
        "--seed", str(seed),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    log.write_text(done.stdout + done.stderr)
    losses = [float(m.group(2)) for m in LOSS_LINE.finditer(done.stdout)]
    if len(losses) != steps:  # the exit status is not checked: the example's end (rank 0 alone samples and
        # saves the model) needs the other rank at stage 3; the losses are what is measured
        sys.exit(f"{name}: exit {done.returncode}, {len(losses)} of {steps} losses; see {work}")
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--tail", type=int, default=20, help="losses averaged at the end")
    parser.add_argument("--work", type=Path, default=None, help="where configs and logs go (a temp dir)")
    parser.add_argument("--seed", type=int, default=1234, help="the example's seed (the same for every run)")
    parser.add_argument("--only", default=",".join(RUNS), help="comma-separated runs (plain is always run)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="zeropp_loss_"))
    work.mkdir(parents=True, exist_ok=True)
    finals: dict[str, float] = {}
    wanted = {"plain", *args.only.split(",")}
    for name in (n for n in RUNS if n in wanted):
        losses = run(name, args.steps, work, args.seed)
        finals[name] = statistics.fmean(losses[-args.tail :])
        ratio = finals[name] / finals["plain"]
        print(
            f"{name:8s} first {losses[0]:.4f}  mean of last {args.tail} {finals[name]:.4f}  ratio to plain {ratio:.4f}",
            flush=True,
        )


if __name__ == "__main__":
    main()

"""Benchmark of one training step: Slipstream ZeRO stages 0, 1, 2 against PyTorch DDP and DeepSpeed.

    python bench/zero_step.py [--quick] [--steps 30] [--repeats 1] [--peer-python .bench-venv/bin/python]

Owns the comparison table of the engine issue: median step time (forward + backward + optimizer step,
slowest rank) and peak RSS per rank, on 2 ranks (gloo on CPU, one thread each), for
- Slipstream stages 0, 1, 2 (`slipstream.initialize` with the DeepSpeed JSON config of `_zero_common.ds_config`),
- PyTorch DDP + torch.optim.AdamW (+ clip_grad_norm_ 1.0), the reference for stage 0,
- DeepSpeed stages 0, 1, 2 with the same JSON, when the peer environment exists (bench/make_peer_venv.sh
  creates .bench-venv); DeepSpeed runs there, in bench/_deepspeed_peer.py, and answers with JSON.
Every run uses the same model (the example GPT, sized by `BenchSpec`), seed and micro-batches, and fresh
processes, so each RSS high-water mark belongs to one framework and stage. The final loss of every run is
printed as a sanity check (same data and init: the runs should agree to a few decimals).
Targets (reported, not asserted): Slipstream at least as fast as DeepSpeed at every stage, and within 1.1x
of DDP at stage 0. `--repeats N` runs the whole sequence N times and keeps each row's best median.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
for path in (str(BENCH_DIR), str(ROOT)):
    if path not in sys.path:
        sys.path.insert(0, path)

import torch  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from _zero_common import (BenchSpec, build_model, ds_config, make_batches, model_state_bytes,  # noqa: E402
                          rss_mib, spawn_run, summarise, timed_loop)

STAGES = (0, 1, 2)


def slipstream_worker(rank: int, spec: BenchSpec, *, stage: int) -> dict[str, Any] | None:
    import slipstream

    vocab_size, batches = make_batches(spec, rank)
    model = build_model(spec, vocab_size)
    rss_before = rss_mib()
    engine, _, _, _ = slipstream.initialize(model=model, config=ds_config(spec, stage=stage))

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = engine(inputs, targets)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    times, losses = timed_loop(step, batches)
    owned_fn = getattr(engine.optimizer, "owned_bytes", None)
    owned = sum(owned_fn().values()) if owned_fn is not None else None
    return summarise(spec, times=times, losses=losses, owned_bytes=owned, rss_before_mib=rss_before,
                     num_params=model.num_parameters())


def ddp_worker(rank: int, spec: BenchSpec) -> dict[str, Any] | None:
    vocab_size, batches = make_batches(spec, rank)
    model = build_model(spec, vocab_size)
    rss_before = rss_mib()
    ddp = DistributedDataParallel(model, bucket_cap_mb=spec.bucket_numel * 4 / 2**20)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = ddp(inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    times, losses = timed_loop(step, batches)
    for param in model.parameters():  # count gradients as allocated during the step
        param.grad = torch.zeros_like(param)
    owned = model_state_bytes(model, optimizer)
    return summarise(spec, times=times, losses=losses, owned_bytes=owned, rss_before_mib=rss_before,
                     num_params=model.num_parameters())


def deepspeed_run(peer_python: Path, spec: BenchSpec, *, stage: int, timeout_s: float) -> dict[str, Any]:
    """One DeepSpeed run in the peer interpreter; its last stdout line is the result as JSON."""
    cmd = [str(peer_python), str(BENCH_DIR / "_deepspeed_peer.py"), "--stage", str(stage), "--spec", spec.to_json()]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-25:])
        raise RuntimeError(f"DeepSpeed stage {stage} run failed (exit {done.returncode}):\n{tail}")
    return json.loads(lines[-1])


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _ratio(num: float | None, den: float | None) -> str:
    return "-" if num is None or den is None else f"{num / den:.2f}x"


def print_table(results: dict[str, dict[str, Any]]) -> None:
    """One row per stage: step times, the two target ratios, peak RSS and owned MiB per rank."""
    def get(name: str, key: str) -> float | None:
        return results.get(name, {}).get(key)

    header = (f"{'stage':>5} | {'Slipstream ms':>13} | {'DDP ms':>7} | {'DeepSpeed ms':>12} | {'DS/Slip':>7} | "
              f"{'Slip/DDP':>8} | {'RSS MiB Slip':>12} | {'RSS DDP':>7} | {'RSS DS':>7} | {'owned MiB Slip':>14}"
              f" | {'owned DDP':>9}")
    print(header)
    print("-" * len(header))
    ddp_ms = get("ddp", "median_ms")
    for stage in STAGES:
        slip, ds = get(f"slipstream{stage}", "median_ms"), get(f"deepspeed{stage}", "median_ms")
        is_zero = stage == 0
        print(f"{stage:>5} | {_ms(slip):>13} | {_ms(ddp_ms) if is_zero else '':>7} | {_ms(ds):>12} | "
              f"{_ratio(ds, slip):>7} | {_ratio(slip, ddp_ms) if is_zero else '':>8} | "
              f"{_ms(get(f'slipstream{stage}', 'peak_rss_mib')):>12} | "
              f"{_ms(get('ddp', 'peak_rss_mib')) if is_zero else '':>7} | "
              f"{_ms(get(f'deepspeed{stage}', 'peak_rss_mib')):>7} | "
              f"{_ms(get(f'slipstream{stage}', 'owned_mib')):>14} | "
              f"{_ms(get('ddp', 'owned_mib')) if is_zero else '':>9}")
    print("\nper run: median / mean step ms, peak RSS, RSS before the framework was built, final loss")
    for name, res in results.items():
        print(f"  {name:<12} {res['median_ms']:8.1f} / {res['mean_ms']:8.1f} ms   peak {res['peak_rss_mib']:7.1f} "
              f"MiB  (before init {res['rss_before_mib']:7.1f})   loss {res['first_loss']:.4f} -> "
              f"{res['final_loss']:.4f}")


def _keep_best(results: dict[str, dict[str, Any]], name: str, result: dict[str, Any]) -> None:
    if name not in results or result["median_ms"] < results[name]["median_ms"]:
        results[name] = result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 warmup + 3 timed steps")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per run")
    parser.add_argument("--repeats", type=int, default=1, help="run everything N times, keep the best median")
    parser.add_argument("--peer-python", type=Path, default=ROOT / ".bench-venv" / "bin" / "python",
                        help="interpreter of the DeepSpeed peer environment (bench/make_peer_venv.sh)")
    parser.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeed rows")
    args = parser.parse_args()
    spec = BenchSpec(steps=3 if args.quick else args.steps, warmup=2 if args.quick else args.warmup)
    use_ds = not args.no_deepspeed and args.peer_python.exists()
    if not use_ds and not args.no_deepspeed:
        print(f"note: no DeepSpeed peer at {args.peer_python}; run `bash bench/make_peer_venv.sh` for those rows")
    print(f"model: GPT {spec.n_layer} layers x {spec.n_embd}, {spec.world_size} ranks (gloo, 1 thread each), micro "
          f"batch {spec.micro_batch} x {spec.block_size} tokens, fp32 AdamW, clip 1.0, buckets "
          f"{spec.bucket_numel:,} elements; {spec.warmup} warmup + {spec.steps} timed steps per run")

    results: dict[str, dict[str, Any]] = {}
    started = time.perf_counter()
    for _ in range(args.repeats if not args.quick else 1):
        _keep_best(results, "ddp", spawn_run(ddp_worker, spec))
        for stage in STAGES:
            _keep_best(results, f"slipstream{stage}", spawn_run(slipstream_worker, spec, stage=stage))
        for stage in STAGES if use_ds else ():
            try:
                _keep_best(results, f"deepspeed{stage}",
                           deepspeed_run(args.peer_python, spec, stage=stage, timeout_s=600))
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                print(f"warning: {exc}", file=sys.stderr)
    if results:
        print(f"model parameters: {next(iter(results.values()))['num_params']:,}")
    print()
    print_table(results)
    print(f"\nbenchmark wall time {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

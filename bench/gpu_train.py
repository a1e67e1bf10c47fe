"""Training throughput on one GPU: a ~1B Llama-style bf16 decoder, Slipstream against DeepSpeed on the same card in
the same run, one rank on NCCL, every ZeRO configuration a row.

    python bench/gpu_train.py [--out DIR] [--rows zero0,zero2,...] [--frameworks slipstream,deepspeed]
                              [--layers 16] [--width 2048] [--seq 2048] [--batch 4] [--steps 5] [--warmup 2]
                              [--budget 450] [--row-timeout 100] [--peer-python PY] [--peer-path DIR:DIR]
                              [--dry-run]

Rows (bench/_gpu_train_row.py `ROWS`): ZeRO-0, ZeRO-2, ZeRO-3, ZeRO-3 with activation checkpointing, ZeRO-3 +
CPU optimizer offload, ZeRO-3 + parameter and optimizer offload, compiled ZeRO-3 (`engine.compile()`; "not
available" where the framework has none). Each row and framework runs in its own process under a timeout, so an
OOM or a hang costs that row only; rows left when `--budget` seconds are spent are marked "skipped (budget)".
Measured per row: tokens/s, MFU (model FLOPs per token, 6 N + the attention term, against the card's dense bf16
peak from slipstream/accelerator/peak.py), peak device memory against the planner's prediction
(slipstream.planner, model states + activations for the row's config), peak host RSS, and the mean step split
into forward, backward and optimizer (device synchronised between phases). DeepSpeed runs with `--peer-python`
(default .bench-venv/bin/python) and `--peer-path` as its PYTHONPATH, without Slipstream on the path; its rows
say "not installed" when it cannot be imported. Writes gpu_train.json and gpu_train.md under --out (default
$OUT, else gpu-bench-out). `--dry-run` runs every row on the CPU (gloo) with a tiny model in seconds.
tools/gpu_bench.sh runs this on a GPU machine with no network.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = ROOT / "bench"
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(ROOT))

from _gpu_train_row import MARK, ROWS, Llama, NotAvailable, ds_config, run  # noqa: E402

FRAMEWORKS = ("slipstream", "deepspeed")
DRY_DIMS = {"layers": 2, "width": 64, "heads": 4, "vocab": 256, "seq": 32, "batch": 2, "steps": 2, "warmup": 1}
MIB = 2**20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu-bench-out")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    for name, default in (("layers", 16), ("width", 2048), ("heads", 16), ("vocab", 32000), ("seq", 2048)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--batch", type=int, default=4, help="micro batch (sequences per step)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per row before the timed ones")
    parser.add_argument("--budget", type=float, default=450.0, help="seconds for all rows together")
    parser.add_argument(
        "--row-timeout", type=float, default=100.0, help="seconds per row (compiled and DeepSpeed rows: 2x)"
    )
    parser.add_argument("--peer-python", default=str(ROOT / ".bench-venv" / "bin" / "python"))
    parser.add_argument("--peer-path", default="", help="PYTHONPATH of the DeepSpeed rows")
    parser.add_argument("--dry-run", action="store_true", help="tiny model on the CPU (gloo): checks the script")
    parser.add_argument("--in-process", action="store_true", help="dry run: every row in this process (the test)")
    args = parser.parse_args(argv)
    for name in args.rows.split(","):
        if name not in ROWS:
            parser.error(f"--rows: unknown row {name!r}; the rows are {', '.join(ROWS)}")
    for name in args.frameworks.split(","):
        if name not in FRAMEWORKS:
            parser.error(f"--frameworks: unknown framework {name!r}; choose from {', '.join(FRAMEWORKS)}")
    if args.in_process and not args.dry_run:
        parser.error("--in-process runs rows without their own process and timeout: only with --dry-run")
    if args.dry_run:
        vars(args).update(DRY_DIMS)
    return args


def row_spec(args: argparse.Namespace, framework: str, row: str) -> dict[str, Any]:
    keys = ("layers", "width", "heads", "vocab", "seq", "batch", "steps", "warmup", "dry_run")
    return {"framework": framework, "row": row, **{key: getattr(args, key) for key in keys}}


def run_one(args: argparse.Namespace, framework: str, row: str, timeout: float) -> dict[str, Any]:
    """One row of one framework in a fresh process; a crash, OOM or timeout becomes the row's status."""
    if args.in_process:
        return _run_here(row_spec(args, framework, row))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    python = sys.executable
    if framework == "deepspeed":
        python, env["PYTHONPATH"] = args.peer_python, args.peer_path
        # Its JIT-built ops (FusedAdam, CPU Adam) in this run's folder, built by the first row that needs them
        # and reused by the next: a row killed while it compiles leaves a lock there, not in the cache other
        # DeepSpeed runs share, and rows run one at a time, so any lock found there is stale (torch's build would
        # wait for it forever).
        ext = Path(
            env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(tempfile.gettempdir()) / f"gpu_train_ext_{os.getpid()}"))
        )
        for lock in ext.glob("*/lock"):
            lock.unlink()
        if not Path(python).exists() and "/" in python:
            return {"status": "not installed", "reason": f"no peer interpreter at {python}"}
    if args.dry_run:
        env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    cmd = [python, str(BENCH_DIR / "_gpu_train_row.py"), json.dumps(row_spec(args, framework, row))]
    started = time.perf_counter()
    # A session of its own: a timeout ends the row's whole process group (a JIT compiler it started included).
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"status": "timeout", "reason": f"still running after {timeout:.0f} s", "wall_s": timeout}
    wall = time.perf_counter() - started
    for line in stdout.splitlines():
        if line.startswith(MARK):
            return {**json.loads(line[len(MARK) :]), "wall_s": wall}
    tail = (stderr or stdout).strip().splitlines()[-3:]
    failed = "not installed" if "No module named 'deepspeed'" in stderr else "failed"
    if "out of memory" in stderr.lower():
        failed = "oom"
    return {"status": failed, "reason": " | ".join(tail)[-400:], "rc": proc.returncode, "wall_s": wall}


def _run_here(spec: dict[str, Any]) -> dict[str, Any]:
    """`--in-process` (dry runs only): the row in this process, an exception its failure."""
    started = time.perf_counter()
    try:
        result = run(spec)
    except NotAvailable as missing:
        result = {"status": "not available", "reason": str(missing)}
    except Exception as error:  # a failing row is a result, not the end of the run
        result = {"status": "failed", "reason": f"{type(error).__name__}: {error}"[-400:]}
    return {**result, "wall_s": time.perf_counter() - started}


def planner_prediction(args: argparse.Namespace, row: str) -> dict[str, int] | None:
    """The planner's per-device bytes for the row's config: model states, and activations (checkpointed when the
    row checkpoints). None when the planner cannot answer (its error is not the benchmark's)."""
    import torch

    from slipstream.planner import estimate

    with torch.device("meta"):
        model = Llama(row_spec(args, "slipstream", row)).to(torch.bfloat16)
    try:
        plan = estimate(
            model=model,
            hidden=args.width,
            layers=args.layers,
            heads=args.heads,
            vocab=args.vocab,
            seq=args.seq,
            micro_batch=args.batch,
            ds_config=ds_config(row, vars(args)),
            fused_attention=True,
        )
    except (ValueError, KeyError, TypeError) as error:
        print(f"planner: no prediction for {row}: {error}", file=sys.stderr)
        return None
    config = plan.estimates[0]
    activations = config.activations_checkpointed if ROWS[row][1] else config.activations
    states = sum(config.device.values())
    return {"states": states, "activations": activations or 0, "total": states + (activations or 0)}


def mfu(result: dict[str, Any]) -> float | None:
    """Achieved model FLOP/s over the card's dense bf16 peak; None off the GPU or on a card not in the table."""
    import torch

    from slipstream.accelerator.peak import peak_flops

    peak = peak_flops(result["device"], torch.bfloat16)
    if peak is None:
        return None
    return result["tokens_per_s"] * result["flops_per_token"] / peak


def run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (row, framework) in order, within the budget; Slipstream and DeepSpeed alternate row by row."""
    deadline = time.monotonic() + args.budget
    results: list[dict[str, Any]] = []
    for row in args.rows.split(","):
        predicted = planner_prediction(args, row)
        for framework in args.frameworks.split(","):
            # Compiled rows compile, and DeepSpeed's first rows JIT-build their optimizer ops: twice the time.
            timeout = args.row_timeout * (2 if ROWS[row][2] or framework == "deepspeed" else 1)
            left = deadline - time.monotonic()
            if left < min(timeout, 30.0):
                result: dict[str, Any] = {"status": "skipped (budget)", "reason": f"{max(left, 0):.0f} s left"}
            else:
                result = run_one(args, framework, row, min(timeout, left))
            if result["status"] == "ok":
                result["mfu"] = mfu(result)
            results.append({"row": row, "framework": framework, "predicted": predicted, **result})
            print(format_line(results[-1]), flush=True)
    return results


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / MIB:,.0f}"


def format_line(r: dict[str, Any]) -> str:
    """One markdown table row."""
    if r["status"] != "ok":
        return f"| {r['row']} | {r['framework']} | {r['status']}: {r.get('reason', '')} |" + " |" * 9
    predicted = r["predicted"]["total"] if r["predicted"] else None
    fraction = "-" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%"
    cells = [
        r["row"],
        f"{r['framework']} {r['version']}",
        f"{r['tokens_per_s']:,.0f}",
        fraction,
        f"{1000 * r['step_s']:,.1f}",
        f"{1000 * r['forward_s']:,.1f}",
        f"{1000 * r['backward_s']:,.1f}",
        f"{1000 * r['optimizer_s']:,.1f}",
        _mib(r["peak_device_bytes"]),
        _mib(predicted),
        _mib(r["peak_host_rss_bytes"]),
        f"{r['last_loss']:.3f}",
    ]
    return "| " + " | ".join(cells) + " |"


HEADER = (
    "| row | framework | tokens/s | MFU | step ms | fwd ms | bwd ms | opt ms | peak dev MiB | planner MiB "
    "| host RSS MiB | loss |\n|" + "---|" * 12
)


def write_outputs(args: argparse.Namespace, results: list[dict[str, Any]], wall: float) -> Path:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dims = {key: getattr(args, key) for key in ("layers", "width", "heads", "vocab", "seq", "batch", "steps")}
    params = next((r["params"] for r in results if r["status"] == "ok"), None)
    report = {"dims": dims, "params": params, "dry_run": args.dry_run, "wall_s": wall, "rows": results}
    (out / "gpu_train.json").write_text(json.dumps(report, indent=1) + "\n")
    device = next((r["device"] for r in results if r["status"] == "ok"), "no row ran")
    title = f"# gpu_train on {device}: {params or 0:,} parameters, {json.dumps(dims)}, {wall:.0f} s\n\n"
    table = "\n".join([HEADER, *(format_line(r) for r in results)])
    (out / "gpu_train.md").write_text(title + table + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    print(HEADER, flush=True)
    results = run_all(args)
    out = write_outputs(args, results, time.perf_counter() - started)
    print(f"wrote {out / 'gpu_train.json'} and {out / 'gpu_train.md'}")
    # The exit status: 1 when no row ran or a Slipstream row failed (DeepSpeed's failures are its rows' news).
    ran = any(r["status"] == "ok" for r in results)
    fine = ("ok", "not available", "skipped (budget)")
    return 0 if ran and all(r["status"] in fine for r in results if r["framework"] == "slipstream") else 1


if __name__ == "__main__":
    sys.exit(main())

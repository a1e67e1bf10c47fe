"""Benchmark of the memory planner: predicted against measured, for Slipstream and for DeepSpeed's own estimator.

    python bench/planner.py [--quick] [--layers 4] [--width 512] [--memory-steps 3]
                            [--peer-python .bench-venv/bin/python] [--no-deepspeed]

Owns the table of the planner issue. The model is the example GPT of `_zero_common` (2 ranks, gloo on CPU,
fp32 AdamW, micro batch 4 x 64 tokens), trained with the same JSON by both frameworks. For each configuration
(stages 0-3, optimizer offload, stage-3 parameter offload) one fresh rank group per framework runs
`--memory-steps` steps and reports, per rank (the highest rank's), the RSS high-water mark over the RSS before the
model and engine were built (see [Note: planner bench baseline]), and for Slipstream the bytes
`engine.optimizer.owned_bytes()` counts. The rank groups are zero_step.RankGroup's, served by `serve_row`. Columns:
    Slipstream  states: `slipstream.planner.estimate(...)`'s model states against owned_bytes();
                peak:   the planner's per-rank device + host + activations (flash-style attention: the model
                        uses scaled_dot_product_attention) against the measured RSS delta;
    DeepSpeed   estimator: DeepSpeed 0.19's `estimate_zero2/3_model_states_mem_needs` for this model (per GPU,
                plus the per-node CPU figure split over the node's ranks when the optimizer is offloaded; its
                CPU figure without offload is the model-loading allowance, not held while training) against
                DeepSpeed's measured RSS delta. Run in the peer environment (bench/make_peer_venv.sh).
On the CPU device and host memory are the same RSS, so "peak" compares the sum. Ranks run with
MALLOC_MMAP_THRESHOLD_=65536 (unless --glibc-default-malloc): glibc then maps every buffer of 64 KiB or more
directly and unmaps it when freed, so the RSS peak measures live tensors rather than heap fragmentation (with
glibc's default dynamic threshold the measured peaks of both frameworks come out 5-25% higher). The measured delta also
holds what the framework allocates besides model states and activations (autograd temporaries, gloo), for both.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
for _path in (str(BENCH_DIR), str(ROOT)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch
import torch.distributed as dist
from _zero_common import REPLY_MARK, BenchSpec, build_model, ds3_config, ds_config, make_batches
from torch import nn
from zero_step import RankGroup

ROWS = [(0, False, False), (1, False, False), (2, False, False), (3, False, False), (1, True, False),
        (2, True, False), (3, True, False), (3, True, True)]
QUICK_ROWS = [(0, False, False), (2, False, False), (3, False, False), (2, True, False)]
MIB = 2**20


def row_name(stage: int, offload: bool, offload_param: bool) -> str:
    return f"zero{stage}" + ("+offload" if offload else "") + ("+param" if offload_param else "")


ROW_BY_NAME = {row_name(*row): row for row in ROWS}


def config_for(spec: BenchSpec, stage: int, offload: bool, offload_param: bool) -> dict[str, Any]:
    """The JSON both frameworks get: zero_step's config; stage 3 as in zero3_step (threshold 1e4)."""
    if stage == 3:
        config = ds3_config(spec, offload_optimizer=offload, offload_param=offload_param)
    else:
        config = ds_config(spec, stage=stage)
        if offload:
            config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    for key in ("offload_optimizer", "offload_param"):
        if key in config["zero_optimization"]:
            config["zero_optimization"][key]["pin_memory"] = False
    return config


def build_engine(framework: str, model: nn.Module, config: dict[str, Any]) -> tuple[Any, Callable[[], int | None]]:
    """(engine, owned-bytes figure) of `framework`: "slipstream", or "deepspeed" in the peer environment."""
    if framework == "slipstream":
        import slipstream

        engine = slipstream.initialize(model=model, config=config)[0]
        owned = engine.optimizer.owned_bytes
        return engine, lambda: sum(v for k, v in owned().items() if k != "offloaded_params")
    import logging

    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    return deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)[0], lambda: None


def _status_kib(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    return int(match.group(1)) if match else 0


def serve_row(rank: int, store: str, spec: BenchSpec, name: str) -> None:
    """One rank of one row ([Note: rank servers] in _zero_common: "ready", then "run", "memory", "quit").

    [Note: planner bench baseline] The framework is imported and run once on a tiny model first (its code,
    native ops and communication setup are loaded), then the RSS is read and the high-water mark reset
    (/proc/self/clear_refs, where the kernel allows it); the row's figure is the high-water mark after its
    steps minus that RSS. The model is built after the baseline, as in the tests (tests/dist/planner)."""
    framework, row = name.split(":")[0], ROW_BY_NAME[name.split(":")[1]]
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(spec.world_size),
                       "LOCAL_WORLD_SIZE": str(spec.world_size), "OMP_NUM_THREADS": "1"})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, spec.world_size), rank=rank,
                            world_size=spec.world_size, timeout=timedelta(minutes=10))
    try:
        vocab, batches = make_batches(spec, rank)
        tiny = dataclasses.replace(spec, n_layer=1, n_embd=32, n_head=2)
        warm, _ = build_engine(framework, build_model(tiny, vocab), config_for(tiny, *row))
        for inputs, targets in batches[:2]:
            warm.backward(warm(inputs, targets))
            warm.step()
        del warm
        gc.collect()
        with contextlib.suppress(OSError):
            Path("/proc/self/clear_refs").write_text("5")
        before = _status_kib("VmRSS")
        engine, owned = build_engine(framework, build_model(spec, vocab), config_for(spec, *row))
        _reply(rank, {"ready": True})
        for line in sys.stdin:
            command = json.loads(line)
            if command["op"] == "quit":
                break
            if command["op"] == "run":
                for i in range(int(command["steps"])):
                    inputs, targets = batches[i % len(batches)]
                    engine.backward(engine(inputs, targets))
                    engine.step()
                _reply(rank, {})
            elif command["op"] == "memory":
                figures = [None] * spec.world_size
                mine = {"delta_kib": max(_status_kib("VmHWM"), _status_kib("VmRSS")) - before, "owned": owned()}
                dist.all_gather_object(figures, mine)
                _reply(rank, {"delta_mib": max(f["delta_kib"] for f in figures) / 1024,  # type: ignore[index]
                              "owned_mib": None if mine["owned"] is None else
                              max(f["owned"] for f in figures) / MIB})  # type: ignore[index]
    finally:
        dist.destroy_process_group()


def _reply(rank: int, payload: dict[str, Any]) -> None:
    if rank == 0:
        sys.stdout.write(REPLY_MARK + json.dumps(payload) + "\n")
        sys.stdout.flush()


def measure(python: Path, name: str, spec: BenchSpec, steps: int, workdir: Path) -> dict[str, Any] | None:
    """A fresh rank group for one row ("framework:row"): RSS delta and owned MiB per rank; None when it failed."""
    try:
        group = RankGroup(python, Path(__file__).resolve(), [name], spec, workdir / name.replace(":", "-"))
    except RuntimeError as exc:
        print(f"  {name}: failed to start ({str(exc).splitlines()[0]})", flush=True)
        return None
    try:
        group.send({"op": "run", "steps": steps})
        return group.send({"op": "memory"})
    except (RuntimeError, BrokenPipeError) as exc:
        print(f"  {name}: failed ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})", flush=True)
        return None
    finally:
        group.close()


def our_prediction(spec: BenchSpec, vocab: int, row: tuple[int, bool, bool]) -> dict[str, float]:
    from slipstream.planner import estimate

    with torch.device("meta"):
        model = build_model(spec, vocab)
    plan = estimate(model=model, ds_config=config_for(spec, *row), gpus_per_node=spec.world_size,
                    seq=spec.block_size, micro_batch=spec.micro_batch, hidden=spec.n_embd, layers=spec.n_layer,
                    heads=spec.n_head, vocab=vocab, fused_attention=True)
    est = plan.estimate_for("config")
    peak = sum(est.device.values()) + sum(est.host.values()) + (est.activations or 0)
    return {"states_mib": est.model_states / MIB, "peak_mib": peak / MIB}


_DS_ESTIMATE = """
import json, sys
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs as z2
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs as z3
total, largest, gpus, stage, offload, offload_param = json.loads(sys.argv[1])
if stage == 3:
    cpu, gpu, _ = z3(total, largest, num_gpus_per_node=gpus, cpu_offload=offload, cpu_offload_params=offload_param,
                     zero_init=False)
else:
    cpu, gpu = z2(total, num_gpus_per_node=gpus, cpu_offload=offload)
print("@@ds", json.dumps([cpu, gpu]))
"""


def deepspeed_estimate(python: Path, spec: BenchSpec, vocab: int, row: tuple[int, bool, bool]) -> float | None:
    """DeepSpeed's estimator for this model, per rank in MiB (see the module doc), from the peer environment."""
    with torch.device("meta"):
        model = build_model(spec, vocab)
    total = sum({id(p): p.numel() for p in model.parameters()}.values())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    stage, offload, offload_param = row
    args = json.dumps([total, largest, spec.world_size, stage, offload, offload_param])
    result = subprocess.run([str(python), "-c", _DS_ESTIMATE, args], check=False, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": ""})
    lines = [line for line in result.stdout.splitlines() if line.startswith("@@ds ")]
    if not lines:
        return None
    cpu, gpu = json.loads(lines[-1][5:])
    return (gpu + (cpu / spec.world_size if offload else 0)) / MIB


def _err(predicted: float | None, measured: float | None) -> str:
    if predicted is None or measured is None or measured <= 0:
        return "-"
    return f"{100 * (predicted - measured) / measured:+.0f}%"


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def print_table(rows: list[dict[str, Any]]) -> None:
    header = (f"{'config':<20} | {'states pred':>11} | {'owned':>7} | {'err':>5} | {'peak pred':>9} | "
              f"{'peak meas':>9} | {'err':>5} || {'DS estimator':>12} | {'DS peak meas':>12} | {'err':>5}")
    print(header + "\n" + "-" * len(header))
    for r in rows:
        print(f"{r['name']:<20} | {_mib(r['states_mib']):>11} | {_mib(r['owned_mib']):>7} | "
              f"{_err(r['states_mib'], r['owned_mib']):>5} | {_mib(r['peak_mib']):>9} | {_mib(r['ours_delta']):>9} | "
              f"{_err(r['peak_mib'], r['ours_delta']):>5} || {_mib(r['ds_estimate']):>12} | "
              f"{_mib(r['ds_delta']):>12} | {_err(r['ds_estimate'], r['ds_delta']):>5}")
    print("MiB per rank; Slipstream states = planner model states vs engine.optimizer.owned_bytes(); peak = planner "
          "device + host + activations vs RSS high-water mark over the pre-engine RSS; DeepSpeed's estimator vs "
          "DeepSpeed's RSS delta on the same model and JSON")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"rows {[row_name(*r) for r in QUICK_ROWS]}, 2 steps")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--memory-steps", type=int, default=3, help="steps before reading the memory figures")
    parser.add_argument("--peer-python", type=Path, default=ROOT / ".bench-venv" / "bin" / "python",
                        help="interpreter of the DeepSpeed peer environment (bench/make_peer_venv.sh)")
    parser.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeed columns")
    parser.add_argument("--glibc-default-malloc", action="store_true",
                        help="leave glibc's dynamic mmap threshold on (freed heap memory then inflates the RSS peak)")
    args = parser.parse_args()
    if not args.glibc_default_malloc:  # inherited by every rank of both frameworks (see the module doc)
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    rows = QUICK_ROWS if args.quick else ROWS
    steps = 2 if args.quick else args.memory_steps
    spec = BenchSpec(n_layer=args.layers, n_embd=args.width)
    vocab, _ = make_batches(BenchSpec(num_batches=1), 0)
    use_peer = not args.no_deepspeed and args.peer_python.exists()
    if not use_peer and not args.no_deepspeed:
        print(f"note: no DeepSpeed peer at {args.peer_python}; `bash bench/make_peer_venv.sh` adds those columns")
    print(f"GPT {spec.n_layer} layers x {spec.n_embd}, {spec.world_size} ranks (gloo, 1 thread each), micro batch "
          f"{spec.micro_batch} x {spec.block_size} tokens, fp32 AdamW; {steps} steps per row", flush=True)
    started = time.perf_counter()
    table = []
    with tempfile.TemporaryDirectory(prefix="planner_bench_") as tmp:
        for row in rows:
            name = row_name(*row)
            ours = measure(Path(sys.executable), f"slipstream:{name}", spec, steps, Path(tmp))
            peer = measure(args.peer_python, f"deepspeed:{name}", spec, steps, Path(tmp)) if use_peer else None
            table.append({"name": name, **our_prediction(spec, vocab, row),
                          "owned_mib": ours and ours["owned_mib"], "ours_delta": ours and ours["delta_mib"],
                          "ds_estimate": deepspeed_estimate(args.peer_python, spec, vocab, row) if use_peer else None,
                          "ds_delta": peer and peer["delta_mib"]})
            print(f"  {name} done ({time.perf_counter() - started:.0f} s)", flush=True)
    print()
    print_table(table)
    print(f"\nbenchmark wall time {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    if "--serve" in sys.argv:  # RankGroup's command line: --serve RANK STORE SPEC_JSON NAME
        rank_arg, store_arg, spec_arg, name_arg = sys.argv[sys.argv.index("--serve") + 1:][:4]
        serve_row(int(rank_arg), store_arg, BenchSpec.from_json(spec_arg), name_arg)
    else:
        sys.exit(main())

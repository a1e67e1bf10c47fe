"""Benchmark of checkpoint save, load and export: Slipstream ZeRO-3 against DeepSpeed ZeRO-3 and DCP.

    python bench/checkpoint.py [--quick] [--layers 5] [--width 2048] [--heads 16] [--frameworks ...]

Owns the checkpoint issue's benchmark table. Same model for all (bench's GPT, head untied, layers x width),
seed and data; 2 ranks (gloo, one thread each), fp32 AdamW: the state is parameters, exp_avg and exp_avg_sq.
The default, 5 x 2048 (252M parameters, largest tensor 64 MiB), is half the issue's 500M: each rank peaks
near 13 bytes per parameter, so 500M (--layers 10) takes ~14 GB for 2 ranks, too much of a shared 24 GiB box.
    slipstream  slipstream.initialize(config=_zero_common.ds3_config); engine.save_checkpoint, load_checkpoint
    deepspeed   the same JSON and calls, DeepSpeed 0.19 in the peer environment (.bench-venv)
    dcp         FSDP2 (fully_shard per block, then the root) + torch AdamW; dcp.save / dcp.load of {"model":
                get_model_state_dict, "optim": get_optimizer_state_dict}, then set_*_state_dict
One framework at a time; its checkpoint is deleted before the next one starts:
    save    a rank group (rank servers as in _zero_common.py, commands in `serve`) steps on batch 0, saves,
            then steps on batch 1
    load    files fsynced and evicted from the page cache (posix_fadvise), a fresh group loads into a fresh
            engine, then steps on batch 1: its loss must equal the save group's
    export  files evicted, then one fresh process runs export_checkpoint (what `slipstream export` runs) or,
            in the peer python, the zero_to_fp32.py DeepSpeed put in the checkpoint (--safe_serialization)
Seconds: barrier to barrier. MB/s: bytes on disk (1 MB = 1e6) / seconds. fsync s: rank 0 then fsyncing the
files (Slipstream and DCP fsync in save, DeepSpeed does not). Peak RSS: VmHWM, reset just before the call, and
its growth over the RSS then (for export, after the imports). Targets (printed, not asserted): save and load
at least as fast as DeepSpeed (save counted without and with DeepSpeed's missing fsync); export at most
zero_to_fp32's time with at most 1/10 of its peak RSS growth.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import json
import logging
import os
import runpy
import shutil
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
from _zero_common import GPT, REPLY_MARK, BenchSpec, GPTConfig, ds3_config, make_batches
from torch import nn
from zero_step import RankGroup

PEER = ["deepspeed"]
EXPORTS = {"slipstream": "slipstream export", "deepspeed": "zero_to_fp32.py"}
FULL = {"n_layer": 5, "n_embd": 2048, "n_head": 16}
QUICK = {"n_layer": 2, "n_embd": 128, "n_head": 4}
TARGET_EXPORT_VS_ZERO_TO_FP32 = 0.1  # peak RSS growth; and the time at most zero_to_fp32's


@dataclasses.dataclass(slots=True)
class Framework:
    """One framework on one rank: a training step and its own save / load calls."""

    step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    save: Callable[[Path], object]
    load: Callable[[Path], object]


def engine_framework(engine: Any) -> Framework:
    """A Slipstream or DeepSpeed engine: both have DeepSpeed's engine API."""

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = engine(inputs, targets)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    def load(path: Path) -> None:
        if engine.load_checkpoint(str(path))[0] is None:
            raise RuntimeError(f"load_checkpoint({path}) found nothing to load")

    return Framework(step=step, save=lambda path: engine.save_checkpoint(str(path)), load=load)


def make_slipstream(spec: BenchSpec, model: nn.Module) -> Framework:
    import slipstream

    return engine_framework(slipstream.initialize(model=model, config=ds3_config(spec))[0])


def make_deepspeed(spec: BenchSpec, model: nn.Module) -> Framework:
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    config = ds3_config(spec)
    return engine_framework(deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                 config=config)[0])


def make_dcp(spec: BenchSpec, model: nn.Module) -> Framework:
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.state_dict as dcp_state
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (spec.world_size,))
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.01)

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = model(inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def state() -> dict[str, Any]:
        return {"model": dcp_state.get_model_state_dict(model),
                "optim": dcp_state.get_optimizer_state_dict(model, optimizer)}

    def load(path: Path) -> None:
        loaded = state()
        dcp.load(loaded, checkpoint_id=str(path))
        dcp_state.set_model_state_dict(model, loaded["model"])
        dcp_state.set_optimizer_state_dict(model, optimizer, loaded["optim"])

    return Framework(step=step, save=lambda path: dcp.save(state(), checkpoint_id=str(path)), load=load)


FACTORIES: dict[str, Callable[[BenchSpec, nn.Module], Framework]] = {
    "slipstream": make_slipstream, "deepspeed": make_deepspeed, "dcp": make_dcp}


def build_model(spec: BenchSpec, vocab_size: int) -> GPT:
    """`_zero_common.build_model` with the head untied from the token embedding: DeepSpeed's zero_to_fp32.py
    --safe_serialization refuses tied weights ("Some tensors share memory")."""
    torch.manual_seed(spec.seed)
    return GPT(GPTConfig(vocab_size=vocab_size, block_size=spec.block_size, n_layer=spec.n_layer,
                         n_head=spec.n_head, n_embd=spec.n_embd, tie_weights=False))


def proc_mib(field: str) -> float:
    """A `/proc/self/status` figure (VmRSS, VmHWM) in MiB."""
    with open("/proc/self/status") as status:
        return int(next(line for line in status if line.startswith(field + ":")).split()[1]) / 1024.0


def reset_peak() -> float:
    """Reset VmHWM to the current RSS (Linux >= 4.0) and return that RSS in MiB."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    return proc_mib("VmRSS")


def files_under(path: Path) -> list[Path]:
    return [p for p in sorted(path.rglob("*")) if p.is_file() and not p.is_symlink()]


def sync_tree(path: Path, *, evict: bool = False) -> None:
    """fsync every file under `path`; with `evict`, then drop its (now clean) pages from the page cache."""
    for file in files_under(path):
        with open(file, "rb") as handle:
            os.fsync(handle.fileno())
            if evict:
                os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def timed(rank: int, call: Callable[[Path], object], path: Path) -> dict[str, Any]:
    """The "save" and "load" commands: `call(path)` between two barriers, its peak RSS, rank 0's fsync."""
    dist.barrier()
    prior_peak = proc_mib("VmHWM")
    rss_before = reset_peak()
    started = time.perf_counter()
    call(path)
    dist.barrier()
    seconds = time.perf_counter() - started
    peak = proc_mib("VmHWM")
    started = time.perf_counter()
    if rank == 0:
        sync_tree(path)
    fsync_seconds = time.perf_counter() - started
    figures: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(figures, (seconds, peak, peak - rss_before, prior_peak))
    worst = [max(f[i] for f in figures) for i in range(4)]
    return {"seconds": worst[0], "fsync_seconds": fsync_seconds, "peak_rss_mib": worst[1],
            "growth_mib": worst[2], "prior_peak_mib": worst[3]}


def serve(rank: int, store: str, spec: BenchSpec, name: str) -> None:
    """A rank server ([Note: rank servers] in _zero_common.py) for one framework. Commands, one JSON per line:
    {"op": "step", "batch": i}, {"op": "save", "path": p}, {"op": "load", "path": p}, {"op": "quit"}."""
    world = str(spec.world_size)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=world, LOCAL_WORLD_SIZE=world)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, spec.world_size), rank=rank,
                            world_size=spec.world_size, timeout=timedelta(minutes=30))
    try:
        vocab_size, batches = make_batches(spec, rank)
        started = time.perf_counter()
        model = build_model(spec, vocab_size)
        num_params = sum(p.numel() for p in model.parameters())
        framework = FACTORIES[name](spec, model)
        reply(rank, {"num_params": num_params, "build_seconds": time.perf_counter() - started})
        for line in sys.stdin:
            command = json.loads(line)
            if command["op"] == "quit":
                break
            if command["op"] == "step":
                losses: list[Any] = [None] * spec.world_size
                dist.all_gather_object(losses, float(framework.step(*batches[command["batch"]])))
                reply(rank, {"loss": sum(losses) / len(losses)})
            elif command["op"] in ("save", "load"):
                reply(rank, timed(rank, getattr(framework, command["op"]), Path(command["path"])))
            else:
                raise ValueError(f"unknown command {command!r}")
    finally:
        dist.destroy_process_group()


def reply(rank: int, payload: dict[str, Any]) -> None:
    if rank == 0:
        print(REPLY_MARK + json.dumps(payload), flush=True)


def export_child(tool: str, ckpt: Path, out: Path) -> None:
    """`--export-child TOOL CKPT OUT`: one conversion in this fresh process; prints its figures as JSON."""
    if tool == "slipstream":
        from slipstream.checkpoint import export_checkpoint

        convert: Callable[[], object] = functools.partial(export_checkpoint, ckpt, out, progress=False)
    else:  # zero_to_fp32.py's imports are loaded before the baseline, as Slipstream's are
        for module in ("deepspeed.utils", "deepspeed.checkpoint.constants", "tqdm", "safetensors.torch"):
            importlib.import_module(module)
        sys.argv = [str(ckpt / "zero_to_fp32.py"), str(ckpt), str(out), "--safe_serialization"]
        convert = functools.partial(runpy.run_path, sys.argv[0], run_name="__main__")
    baseline = reset_peak()
    started = time.perf_counter()
    convert()
    seconds, peak = time.perf_counter() - started, proc_mib("VmHWM")
    reply(0, {"seconds": seconds, "peak_rss_mib": peak, "growth_mib": peak - baseline,
              "out_bytes": sum(p.stat().st_size for p in files_under(out))})


def run_export(python: Path, tool: str, ckpt: Path, out: Path) -> dict[str, Any]:
    """One conversion in a fresh wrapper process (`python checkpoint.py --export-child ...`); its figures."""
    sync_tree(ckpt, evict=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if python.resolve() != Path(sys.executable).resolve():
        env["PYTHONPATH"] = ""  # the peer environment must not see this checkout's packages
    done = subprocess.run([str(python), __file__, "--export-child", tool, str(ckpt), str(out)], cwd=ROOT,
                          env=env, text=True, capture_output=True, check=False)
    shutil.rmtree(out, ignore_errors=True)
    for line in done.stdout.splitlines():
        if line.startswith(REPLY_MARK):
            return json.loads(line[len(REPLY_MARK):])
    raise RuntimeError(f"export with {tool} failed (exit code {done.returncode}):\n{done.stderr[-3000:]}")


def run_group(python: Path, name: str, spec: BenchSpec, workdir: Path, *commands: dict[str, Any]) -> list:
    """A fresh rank group for `name`: its ready reply, then its reply to each command."""
    group = RankGroup(python, Path(__file__).resolve(), [name], spec, workdir)
    try:
        return [group.ready, *(group.send(command) for command in commands)]
    finally:
        group.close()


def run_framework(name: str, python: Path, spec: BenchSpec, workdir: Path) -> dict[str, Any]:
    """The save, load and export phases of one framework (see the module docstring)."""
    ckpt = workdir / f"{name}-ckpt"
    step, save, load = ({"op": "step", "batch": 1}, {"op": "save", "path": str(ckpt)},
                        {"op": "load", "path": str(ckpt)})
    row: dict[str, Any] = {}
    try:
        ready, _, row["save"], after_save = run_group(python, name, spec, workdir / f"{name}-save",
                                                      {"op": "step", "batch": 0}, save, step)
        row |= {**ready, "next_loss": after_save["loss"]}
        files = files_under(ckpt)
        row["bytes"], row["num_files"] = sum(p.stat().st_size for p in files), len(files)
        sync_tree(ckpt, evict=True)
        _, row["load"], after_load = run_group(python, name, spec, workdir / f"{name}-load", load, step)
        row["loaded_loss"] = after_load["loss"]
        print(f"  {name}: saved {row['bytes'] / 1e6:,.0f} MB in {row['save']['seconds']:.1f} s, loaded in "
              f"{row['load']['seconds']:.1f} s", flush=True)
        if name in EXPORTS:
            row["export"] = run_export(python, name, ckpt, workdir / f"{name}-export")
            print(f"  {name}: exported in {row['export']['seconds']:.1f} s", flush=True)
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
    return row


def _ratio(num: float | None, den: float | None) -> str:
    return "-" if num is None or den is None else f"{num / den:.2f}x"


def _get(rows: dict[str, dict[str, Any]], name: str, phase: str, key: str) -> float | None:
    return rows.get(name, {}).get(phase, {}).get(key)


def print_table(rows: dict[str, dict[str, Any]]) -> None:
    header = (f"{'framework':<10} | {'ckpt MB':>7} | {'phase':<5} | {'seconds':>7} | {'MB/s':>6} | "
              f"{'vs DS':>6} | {'vs DCP':>6} | {'fsync s':>7} | {'peak RSS MiB':>12} | {'growth MiB':>10}")
    print(header + "\n" + "-" * len(header))
    for name, row in rows.items():
        for phase in ("save", "load"):
            figures, megabytes = row[phase], row["bytes"] / 1e6
            label, size = (name, f"{megabytes:,.0f}") if phase == "save" else ("", "")
            print(f"{label:<10} | {size:>7} | {phase:<5} | {figures['seconds']:>7.2f} | "
                  f"{megabytes / figures['seconds']:>6.0f} | "
                  f"{_ratio(figures['seconds'], _get(rows, 'deepspeed', phase, 'seconds')):>6} | "
                  f"{_ratio(figures['seconds'], _get(rows, 'dcp', phase, 'seconds')):>6} | "
                  f"{figures['fsync_seconds']:>7.2f} | {figures['peak_rss_mib']:>12.0f} | "
                  f"{figures['growth_mib']:>10.0f}")
    print("\nseconds: barrier to barrier; vs DS, vs DCP: seconds over that framework's (< 1 is faster); "
          "fsync s: rank 0\nfsyncing the files after the call; peak RSS: highest rank's during the call, "
          "growth: over its RSS before it")
    print(f"\n{'export':<17} | {'seconds':>7} | {'peak RSS MiB':>12} | {'growth MiB':>10} | "
          f"{'vs z2fp32':>9} | {'out MB':>6}")
    for name, figures in ((name, row["export"]) for name, row in rows.items() if "export" in row):
        print(f"{EXPORTS[name]:<17} | {figures['seconds']:>7.2f} | {figures['peak_rss_mib']:>12.0f} | "
              f"{figures['growth_mib']:>10.0f} | "
              f"{_ratio(figures['growth_mib'], _get(rows, 'deepspeed', 'export', 'growth_mib')):>9} | "
              f"{figures['out_bytes'] / 1e6:>6,.0f}")
    print("\nchecks: next step's loss, uninterrupted and after load; engine build; peak RSS before the call")
    for name, row in rows.items():
        print(f"  {name:<10} loss {row['next_loss']:.6f} / after load {row['loaded_loss']:.6f} (diff "
              f"{abs(row['next_loss'] - row['loaded_loss']):.1e}); {row['num_files']} files; build "
              f"{row['build_seconds']:.1f} s; peak RSS before save {row['save']['prior_peak_mib']:.0f} MiB, "
              f"before load {row['load']['prior_peak_mib']:.0f} MiB")


def _verdict(ours: float | None, peer: float | None, target: float, what: str) -> str:
    if ours is None or peer is None:
        return f"  {what}: not measured"
    verdict = "met" if ours <= target * peer else "MISSED"
    return f"  {what} {ours / peer:.3f}x (target <= {target}x): {verdict}"


def print_targets(rows: dict[str, dict[str, Any]]) -> None:
    print("\ntargets (reported, not asserted):")
    for phase in ("save", "load"):
        ours, peer = (_get(rows, name, phase, "seconds") for name in EXPORTS)
        print(_verdict(ours, peer, 1.0, f"{phase} time, slipstream over deepspeed:"))
    if all(name in rows for name in EXPORTS):
        durable = [rows[name]["save"]["seconds"] + rows[name]["save"]["fsync_seconds"] for name in EXPORTS]
        print(_verdict(durable[0], durable[1], 1.0, "save + fsync (to a durable checkpoint), the same:"))
    ours, peer = (_get(rows, name, "export", "seconds") for name in EXPORTS)
    print(_verdict(ours, peer, 1.0, "export time, slipstream export over zero_to_fp32:"))
    ours, peer = (_get(rows, name, "export", "growth_mib") for name in EXPORTS)
    print(_verdict(ours, peer, TARGET_EXPORT_VS_ZERO_TO_FP32, "export peak RSS growth, over zero_to_fp32's:"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"smoke run on a tiny model {QUICK}")
    for flag, key in (("--layers", "n_layer"), ("--width", "n_embd"), ("--heads", "n_head")):
        parser.add_argument(flag, dest=key, type=int, default=None, help=f"GPT {key} (full: {FULL[key]})")
    parser.add_argument("--frameworks", default="slipstream,deepspeed,dcp", help="a subset, in this order")
    parser.add_argument("--peer-python", type=Path, default=ROOT / ".bench-venv" / "bin" / "python",
                        help="interpreter of the DeepSpeed peer environment (bench/make_peer_venv.sh)")
    args = parser.parse_args()
    sizes = {**(QUICK if args.quick else FULL), **{k: v for k, v in vars(args).items() if k in FULL and v}}
    spec = BenchSpec(**sizes, micro_batch=1, num_batches=2)
    names = args.frameworks.split(",")
    if unknown := set(names) - set(FACTORIES):
        parser.error(f"--frameworks: unknown {sorted(unknown)}; choose from {sorted(FACTORIES)}")
    if "deepspeed" in names and not args.peer_python.exists():
        names.remove("deepspeed")
        print(f"note: no DeepSpeed peer at {args.peer_python}; `bash bench/make_peer_venv.sh` adds that row")
    print(f"GPT {spec.n_layer} x {spec.n_embd} ({spec.n_head} heads), {spec.world_size} ranks (gloo, 1 thread"
          f" each), ZeRO-3 / FSDP2, fp32 AdamW, one step before saving: {', '.join(names)}", flush=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_checkpoint_", dir="/tmp") as tmp:
        rows = {name: run_framework(name, args.peer_python if name in PEER else Path(sys.executable), spec,
                                    Path(tmp)) for name in names}
    print(f"\nmodel parameters: {next(iter(rows.values()))['num_params']:,}\n")
    print_table(rows)
    print_targets(rows)
    print(f"\nbenchmark wall time {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    if "--serve" in sys.argv:
        rank, store, spec_json, name = sys.argv[sys.argv.index("--serve") + 1 :][:4]
        serve(int(rank), store, BenchSpec.from_json(spec_json), name)
    elif "--export-child" in sys.argv:
        tool, ckpt, out = sys.argv[sys.argv.index("--export-child") + 1 :][:3]
        export_child(tool, Path(ckpt), Path(out))
    else:
        sys.exit(main())

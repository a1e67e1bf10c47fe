"""Benchmark of one training step: Slipstream ZeRO stages 0, 1, 2 against PyTorch DDP and DeepSpeed.

    python bench/zero_step.py [--quick] [--rounds 10] [--chunk 5] [--model gpt|mlp|blocks] [--default-config]
                              [--before DIR] [--rows ddp,slipstream2,...] [--peer-python .bench-venv/bin/python]

Owns the comparison table of the engine issue: median step time (forward + backward + optimizer step, the
slowest rank's), its CPU time, and peak RSS per rank, on 2 ranks (gloo on CPU, one thread each), for
- Slipstream stages 0, 1, 2 (`slipstream.initialize` with the DeepSpeed JSON of `_zero_common.ds_config`),
  and `overlap_comm` the other way round at stages 1 and 2 (slipstream1_overlap: on, slipstream2_no_overlap:
  off; each stage's default is the other row),
- PyTorch DDP + torch.optim.AdamW(fused=True) (+ clip_grad_norm_ 1.0), the reference for every stage (with
  --default-config at DDP's own default bucket size, else `BenchSpec.bucket_numel`'s bytes),
- DeepSpeed stages 0, 1, 2 with the same JSON, when the peer environment exists (bench/make_peer_venv.sh
  creates .bench-venv); DeepSpeed runs there, in bench/_deepspeed_peer.py,
- with --before DIR, Slipstream's stage 1 and 2 rows again on the Slipstream of DIR (another checkout), as
  <row>@before, timed in a group of their own interleaved with the others: before/after from one run.
All of them train the same model (`--model`: the example GPT, the wide MLP or the residual blocks, sized by
`_zero_common.model_spec`) from the same seed on the same micro-batches. Two phases (see [Note: rank servers] in _zero_common.py):
    Memory: one fresh group per framework and stage, a few steps, then its RSS high-water mark and the bytes
            of the tensors the engine owns (`engine.optimizer.owned_bytes()`; params + grads + AdamW state
            for DDP). A fresh group per row keeps each RSS figure to that row alone.
    Time:   two long-lived groups (DDP + Slipstream 0-2 here; DeepSpeed 0-2 in the peer) take turns in
            chunks of `--chunk` steps, round after round, so load drift on a shared machine hits every row
            alike. One warmup round is dropped; the median over the remaining steps is reported.
The mean loss of every row after the same steps is printed as a sanity check: same data, same init, so the
rows agree to a few decimals. Targets (reported, not asserted): Slipstream at least as fast as DeepSpeed at
every stage, within 1.1x of DDP at stages 0 and 2, `overlap_comm` on no slower than off at stages 1 and 2, and
peak RSS per rank at most DeepSpeed's and DDP's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

os.environ.setdefault("OMP_NUM_THREADS", "1")
BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
for _path in (str(BENCH_DIR), str(ROOT)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import torch
from _zero_common import (
    REPLY_MARK,
    BenchSpec,
    Factory,
    Runner,
    describe_model,
    ds_config,
    model_spec,
    model_state_bytes,
    serve_main,
)
from torch import nn

STAGES = (0, 1, 2)
OVERLAP_ROWS = {"slipstream1_overlap": (1, True), "slipstream2_no_overlap": (2, False)}
"""The overlap_comm pairs: each row is its stage's default row with overlap_comm the other way round."""
OURS = ["ddp", "slipstream0", "slipstream1", "slipstream2", *OVERLAP_ROWS]
PEER = ["deepspeed0", "deepspeed1", "deepspeed2"]
BEFORE = "@before"
if "--serve" in sys.argv and BEFORE in sys.argv[-1]:  # a group of --before rows: the Slipstream of DIR
    sys.path.insert(0, os.environ["SLIPSTREAM_BENCH_BEFORE"])


def make_slipstream(stage: int, overlap_comm: bool | None = None) -> Factory:
    def factory(spec: BenchSpec, model: nn.Module) -> Runner:
        import slipstream

        config = ds_config(spec, stage=stage)
        if overlap_comm is not None:
            config["zero_optimization"]["overlap_comm"] = overlap_comm
        engine, _, _, _ = slipstream.initialize(model=model, config=config)

        def step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            loss = engine(inputs, targets)
            engine.backward(loss)
            engine.step()
            return loss.detach()

        owned = getattr(engine.optimizer, "owned_bytes", None)
        return Runner(
            step=step, model=model, owned_bytes=lambda: None if owned is None else sum(owned().values())
        )

    return factory


def make_ddp(spec: BenchSpec, model: nn.Module) -> Runner:
    bucket_cap_mb = None if spec.default_config else spec.bucket_numel * 4 / 2**20  # None: DDP's default, 25
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=spec.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01, fused=True
    )

    def step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = ddp(inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return Runner(step=step, model=model, owned_bytes=lambda: model_state_bytes(model, optimizer))


FACTORIES: dict[str, Factory] = {
    "ddp": make_ddp,
    **{f"slipstream{s}": make_slipstream(s) for s in STAGES},
    **{name: make_slipstream(stage, on) for name, (stage, on) in OVERLAP_ROWS.items()},
}


class RankGroup:
    """`spec.world_size` rank server processes driven over stdin/stdout (see [Note: rank servers])."""

    def __init__(self, python: Path, script: Path, names: list[str], spec: BenchSpec, workdir: Path) -> None:
        self.names = names
        label = "+".join(names)
        workdir.mkdir(parents=True, exist_ok=True)
        store = workdir / "store"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}
        if python.resolve() != Path(sys.executable).resolve():
            env["PYTHONPATH"] = ""  # the peer environment must not see this checkout's packages
        self.logs = [workdir / f"rank{rank}.log" for rank in range(spec.world_size)]
        self.procs = []
        for rank, log in enumerate(self.logs):
            cmd = [
                str(python),
                str(script),
                "--serve",
                str(rank),
                str(store),
                spec.to_json(),
                ",".join(names),
            ]
            self.procs.append(
                subprocess.Popen(
                    cmd,
                    cwd=ROOT,
                    env=env,
                    text=True,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE if rank == 0 else log.open("w"),
                    stderr=subprocess.STDOUT if rank > 0 else log.open("w"),
                )
            )
        self.label = label
        self.ready = self._reply()

    def _reply(self) -> dict[str, Any]:
        stdout: TextIO = self.procs[0].stdout  # type: ignore[assignment]
        for line in stdout:
            if line.startswith(REPLY_MARK):
                return json.loads(line[len(REPLY_MARK) :])
        codes = [p.wait() for p in self.procs]
        logs = "\n".join(
            f"--- {log.name}\n" + "\n".join(log.read_text().splitlines()[-20:]) for log in self.logs
        )
        raise RuntimeError(f"rank group {self.label} stopped (exit codes {codes}) without replying:\n{logs}")

    def send(self, command: dict[str, Any]) -> dict[str, Any] | None:
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(command) + "\n")
            proc.stdin.flush()
        return None if command["op"] == "quit" else self._reply()

    def close(self) -> None:
        if all(p.poll() is None for p in self.procs):
            self.send({"op": "quit"})
        for proc in self.procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


def measure_memory(
    groups_for: dict[str, tuple[Path, Path]], spec: BenchSpec, steps: int, workdir: Path, *, count: bool = False
) -> dict[str, dict[str, Any]]:
    """Memory phase: a fresh group per row, `steps` steps, then its figures (and, with `count`, the
    collectives of one more step, counted by the rank server)."""
    memory = {}
    for name, (python, script) in groups_for.items():
        group = RankGroup(python, script, [name], spec, workdir / f"mem-{name}")
        try:
            group.send({"op": "run", "name": name, "steps": steps})
            figures = group.send({"op": "memory"})
            counts = group.send({"op": "count", "name": name}) if count else {}
            assert figures is not None and counts is not None
            memory[name] = {
                "peak_rss_mib": figures["peak_rss_mib"],
                "rss_before_mib": figures["rss_before_mib"],
                "owned_mib": figures["owned_mib"][name],
                "num_params": group.ready["num_params"],
                **{key: max(values) for key, values in counts.items()},
            }
            print(f"  {name}: done", flush=True)
        finally:
            group.close()
    return memory


def measure_time(groups: list[RankGroup], *, rounds: int, chunk: int) -> dict[str, dict[str, Any]]:
    """Time phase: each row runs `chunk` steps in turn; round 0 is warmup. Times and losses per row."""
    times: dict[str, list[float]] = {name: [] for g in groups for name in g.names}
    losses: dict[str, list[float]] = {name: [] for name in times}
    cpu: dict[str, list[float]] = {name: [] for name in times}  # CPU time per step: what load cannot stretch
    for round_index in range(rounds + 1):
        order = [(g, name) for g in groups for name in g.names]
        shift = round_index % len(order)
        for group, name in order[shift:] + order[:shift]:
            reply = group.send({"op": "run", "name": name, "steps": chunk})
            assert reply is not None
            losses[name] += reply["losses"]
            if round_index > 0:
                times[name] += reply["times"]
                cpu[name] += reply.get("cpu_times", [])
    return {
        name: {
            "median_ms": 1000 * statistics.median(t),
            "mean_ms": 1000 * statistics.fmean(t),
            "median_cpu_ms": 1000 * statistics.median(cpu[name]) if cpu[name] else None,
            "num_steps": len(losses[name]),
            "final_loss": statistics.fmean(losses[name][-chunk:]),
        }
        for name, t in times.items()
    }


def _num(value: float | None, fmt: str = ".1f") -> str:
    return "-" if value is None else format(value, fmt)


def _ratio(num: float | None, den: float | None) -> str:
    return "-" if num is None or den is None else f"{num / den:.2f}x"


def print_table(rows: dict[str, dict[str, Any]]) -> None:
    """One line per stage: step times, the target ratios, CPU time, peak RSS and owned MiB per rank; then the
    overlap_comm pairs and the --before rows."""

    def get(name: str, key: str) -> float | None:
        return rows.get(name, {}).get(key)

    header = (
        f"{'stage':>5} | {'Slipstream ms':>13} | {'DDP ms':>6} | {'DeepSpeed ms':>12} | {'DS/Slip':>7} | "
        f"{'Slip/DDP':>8} | {'CPU Slip/DDP':>12} | {'RSS MiB Slip':>12} | {'RSS DDP':>7} | {'RSS DS':>6} | "
        f"{'owned MiB Slip':>14} | {'owned DDP':>9}"
    )
    print(header + "\n" + "-" * len(header))
    for stage in STAGES:
        ours, peer = f"slipstream{stage}", f"deepspeed{stage}"
        slip_ms, ds_ms, ddp_ms = get(ours, "median_ms"), get(peer, "median_ms"), get("ddp", "median_ms")
        print(
            f"{stage:>5} | {_num(slip_ms):>13} | {_num(ddp_ms):>6} | {_num(ds_ms):>12} | "
            f"{_ratio(ds_ms, slip_ms):>7} | {_ratio(slip_ms, ddp_ms):>8} | "
            f"{_ratio(get(ours, 'median_cpu_ms'), get('ddp', 'median_cpu_ms')):>12} | "
            f"{_num(get(ours, 'peak_rss_mib')):>12} | {_num(get('ddp', 'peak_rss_mib')):>7} | "
            f"{_num(get(peer, 'peak_rss_mib')):>6} | {_num(get(ours, 'owned_mib')):>14} | "
            f"{_num(get('ddp', 'owned_mib')):>9}"
        )
    print("\noverlap_comm (each stage's default row against the row with it the other way round)")
    for name, (stage, on) in OVERLAP_ROWS.items():
        on_row, off_row = (name, f"slipstream{stage}") if on else (f"slipstream{stage}", name)
        print(
            f"  stage {stage}: on {_num(get(on_row, 'median_ms'))} ms, off {_num(get(off_row, 'median_ms'))} ms, "
            f"on/off {_ratio(get(on_row, 'median_ms'), get(off_row, 'median_ms'))} (CPU time "
            f"{_ratio(get(on_row, 'median_cpu_ms'), get(off_row, 'median_cpu_ms'))})"
        )
    for name in [n for n in rows if n.endswith(BEFORE)]:
        after = name.removesuffix(BEFORE)
        print(
            f"  {after}: after/before step time {_ratio(get(after, 'median_ms'), get(name, 'median_ms'))}, CPU "
            f"time {_ratio(get(after, 'median_cpu_ms'), get(name, 'median_cpu_ms'))}, peak RSS "
            f"{_num(get(after, 'peak_rss_mib'))} / {_num(get(name, 'peak_rss_mib'))} MiB"
        )
    print("\nper row: median / mean step ms, median CPU ms, peak RSS (before the engine was built), mean loss of last chunk")
    for name, row in rows.items():
        print(
            f"  {name:<24} {_num(row.get('median_ms')):>7} / {_num(row.get('mean_ms')):>7} ms   CPU "
            f"{_num(row.get('median_cpu_ms')):>7} ms   peak {_num(row.get('peak_rss_mib')):>6} MiB "
            f"({_num(row.get('rss_before_mib')):>6})   loss after {row.get('num_steps', '-')} steps "
            f"{_num(row.get('final_loss'), '.4f')}"
        )


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every ZeRO step benchmark takes (zero_step.py, zero3_step.py)."""
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 1 timed round of 2 steps, 2 memory steps"
    )
    parser.add_argument("--rounds", type=int, default=10, help="timed rounds (after one warmup round)")
    parser.add_argument("--chunk", type=int, default=5, help="steps per row per round")
    parser.add_argument("--memory-steps", type=int, default=5, help="steps before reading the memory figures")
    parser.add_argument(
        "--peer-python",
        type=Path,
        default=ROOT / ".bench-venv" / "bin" / "python",
        help="interpreter of the DeepSpeed peer environment (bench/make_peer_venv.sh)",
    )
    parser.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeed rows")


def parse_run_arguments(parser: argparse.ArgumentParser) -> tuple[argparse.Namespace, bool]:
    """The parsed options (with --quick applied) and whether the DeepSpeed peer rows run."""
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.chunk, args.memory_steps = 1, 2, 2
    use_peer = not args.no_deepspeed and args.peer_python.exists()
    if not use_peer and not args.no_deepspeed:
        print(
            f"note: no DeepSpeed peer at {args.peer_python}; `bash bench/make_peer_venv.sh` adds those rows"
        )
    return args, use_peer


def run_rows(script: Path, ours_names: list[str], peer_names: list[str], spec: BenchSpec, args: argparse.Namespace,
             *, count: bool = False, apart: list[str] | None = None) -> tuple[dict[str, dict[str, Any]], float]:
    """Both phases (see the module doc) for the rows served by `script` (ours) and the peer; returns the rows
    and when the benchmark started. `apart`: more rows of `script`, timed in a group of their own (another
    checkout's code, say: one process imports one slipstream)."""
    ours = (Path(sys.executable), script)
    peer = (args.peer_python, BENCH_DIR / "_deepspeed_peer.py")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"{script.stem}_") as tmp:
        workdir = Path(tmp)
        groups_for = {name: ours for name in ours_names + (apart or [])} | {name: peer for name in peer_names}
        memory = measure_memory(groups_for, spec, args.memory_steps, workdir, count=count)
        print(f"memory phase done in {time.perf_counter() - started:.0f} s", flush=True)
        groups = []
        try:
            if ours_names:
                groups.append(RankGroup(*ours, ours_names, spec, workdir / "time-ours"))
            if peer_names:
                groups.append(RankGroup(*peer, peer_names, spec, workdir / "time-peer"))
            if apart:
                groups.append(RankGroup(*ours, apart, spec, workdir / "time-apart"))
            timing = measure_time(groups, rounds=args.rounds, chunk=args.chunk)
        finally:
            for group in groups:
                group.close()
    rows = {name: {**memory.get(name, {}), **timing.get(name, {})} for name in groups_for}
    print(f"model parameters: {next(iter(memory.values()))['num_params']:,}\n")
    return rows, started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser)
    parser.add_argument("--model", choices=("gpt", "mlp", "blocks"), default="gpt",
                        help="the model of _zero_common.model_spec (blocks: 6 residual blocks, 50.4M, micro batch 32)")
    parser.add_argument("--default-config", action="store_true",
                        help="DeepSpeed's defaults: the JSON has only batch, optimizer, clipping and the stage")
    parser.add_argument("--before", type=Path, default=None,
                        help="another checkout of Slipstream: its stage 1 and 2 rows run too, as <row>@before")
    parser.add_argument("--rows", default=None, help="comma-separated subset of the rows (default: all of them)")
    args, use_peer = parse_run_arguments(parser)
    wanted = args.rows.split(",") if args.rows else OURS + PEER
    if set(wanted) - set(OURS + PEER):
        parser.error(f"--rows: unknown rows {sorted(set(wanted) - set(OURS + PEER))}; choose from {OURS + PEER}")
    spec = model_spec(args.model, quick=args.quick, default_config=args.default_config)
    print(
        f"{describe_model(spec)}, {spec.world_size} ranks (gloo, 1 thread each), fp32 AdamW, clip 1.0, "
        f"zero_optimization {ds_config(spec, stage=2)['zero_optimization']}; {args.rounds} timed rounds x "
        f"{args.chunk} steps per row; load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    apart = []
    if args.before is not None:
        os.environ["SLIPSTREAM_BENCH_BEFORE"] = str(args.before.resolve())
        apart = [f"slipstream{stage}{BEFORE}" for stage in (1, 2) if f"slipstream{stage}" in wanted]
    ours, peer = [n for n in OURS if n in wanted], [n for n in PEER if n in wanted and use_peer]
    rows, started = run_rows(Path(__file__).resolve(), ours, peer, spec, args, apart=apart)
    print_table(rows)
    print(f"\nbenchmark wall time {time.perf_counter() - started:.0f} s, load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    if "--serve" in sys.argv:
        serve_main({**FACTORIES, **{name + BEFORE: factory for name, factory in FACTORIES.items()}}, sys.argv)
    else:
        sys.exit(main())

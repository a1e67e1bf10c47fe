"""Benchmark of the cpu_adam op: params/s of Slipstream's DeepSpeedCPUAdam (native and fallback) against
torch.optim.Adam/AdamW (foreach and fused) and DeepSpeed's DeepSpeedCPUAdam, as a fraction of the
memory-bandwidth floor.

    python bench/cpu_adam.py [--quick] [--peer-python PY] [--sizes 1e7,1e8] [--threads 1,2]

Cases: fp32 params + fp32 states; bf16 params + fp32 states (torch's optimizers keep states in the param
dtype, so their rows move fewer bytes: marked "bf16 states"); offload = fp32 update plus a bf16 copy of the
params (ours writes it in the same pass via low_precision_out, peers run the update and then a separate
.copy_).

Floor: a C++/OpenMP loop with Adam's access pattern (read p, g, m, v; write p, m, v; fp32, same thread count,
no sqrt/div; best of no software prefetch and prefetch 1 or 2 KiB ahead) is timed within every row,
interleaved with the implementations; its GB/s divided by the bytes a case moves per param (fp32: 28,
bf16 params: 22, offload: 30) gives the row's floor in params/s.

DeepSpeed runs in a separate virtual environment (see bench/make_peer_venv.sh), in a subprocess that takes
JSON requests on stdin and answers with its own step times as JSON; Slipstream never imports it.

Timing: every implementation of a row, DeepSpeed included, is stepped in turn, round after round (interleaved,
so drift in machine load hits all alike), and the median step time is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

BYTES_PER_PARAM = {"fp32": 28, "bf16": 22, "offload": 30}
_PROBE = "floor probe, prefetch ahead"
LR, WD = 1e-3, 0.01

_PROBE_SRC = r"""
#include <torch/extension.h>
#include <omp.h>
// Adam's streams without its math: read p, g, m, v; write p, m, v (fp32), static split over threads.
// prefetch_ahead > 0 adds software prefetches that many elements ahead (as the cpu_adam kernel does).
void rmw(at::Tensor p, at::Tensor g, at::Tensor m, at::Tensor v, int64_t threads, int64_t prefetch_ahead) {
  float* P = p.data_ptr<float>(); const float* G = g.data_ptr<float>();
  float* M = m.data_ptr<float>(); float* V = v.data_ptr<float>();
  const int64_t blocks = p.numel() / 16;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t i0 = b * 16;
    if (prefetch_ahead > 0) {
      __builtin_prefetch(P + i0 + prefetch_ahead); __builtin_prefetch(G + i0 + prefetch_ahead);
      __builtin_prefetch(M + i0 + prefetch_ahead); __builtin_prefetch(V + i0 + prefetch_ahead);
    }
#pragma omp simd
    for (int64_t i = i0; i < i0 + 16; ++i) {
      const float gi = G[i];
      M[i] = M[i] * 0.9f + gi; V[i] = V[i] * 0.99f + gi * gi; P[i] = P[i] - 1e-3f * gi;
    }
  }
}
"""

# Runs in the peer environment and answers one JSON line per request on stdin: {"op": "setup", "case", "n",
# "threads", "lr", "wd"} builds deepspeed.ops.adam.DeepSpeedCPUAdam for a row; {"op": "step"} times one step.
_PEER_SRC = r"""
import json, sys, time, torch
from deepspeed.ops.adam import DeepSpeedCPUAdam
print(json.dumps({"ready": True}), flush=True)
step = None
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["op"] == "setup":
        step = None
        torch.set_num_threads(cmd["threads"])
        n, case = cmd["n"], cmd["case"]
        dtype = torch.bfloat16 if case == "bf16" else torch.float32
        p = torch.nn.Parameter(torch.randn(n).to(dtype)); p.grad = (torch.randn(n) * 1e-3).to(dtype)
        out = torch.empty(n, dtype=torch.bfloat16)
        opt = DeepSpeedCPUAdam([p], lr=cmd["lr"], weight_decay=cmd["wd"], adamw_mode=True)
        step = opt.step
        if case == "offload":
            step = lambda o=opt, p=p, out=out: (o.step(), out.copy_(p.detach()))
        print(json.dumps({"ok": True}), flush=True)
    else:
        t = time.perf_counter(); step(); print(json.dumps({"sec": time.perf_counter() - t}), flush=True)
"""


class _Peer:
    """DeepSpeed in its own venv, driven step by step so that its timings interleave with ours."""

    def __init__(self, python: str | None) -> None:
        self.note = ""
        self.proc: subprocess.Popen[str] | None = None
        if not python or not Path(python).exists():
            self.note = f"not available (no peer python at {python}; run bench/make_peer_venv.sh)"
            return
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self.proc = subprocess.Popen([python, "-c", _PEER_SRC], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env, cwd="/")
        if self._request(None) is None:
            return

    def _request(self, cmd: dict | None) -> dict | None:
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        try:
            if cmd is not None:
                self.proc.stdin.write(json.dumps(cmd) + "\n")
                self.proc.stdin.flush()
            while True:
                line = self.proc.stdout.readline()
                if not line:
                    raise RuntimeError("peer exited")
                if line.startswith("{"):
                    return json.loads(line)
        except (OSError, RuntimeError, ValueError):
            err = (self.proc.stderr.read() if self.proc.stderr else "").strip().splitlines()
            self.note = f"not available (peer failed: {(err[-1] if err else 'no output')[:100]})"
            self.proc.kill()
            self.proc = None
            return None

    def setup(self, case: str, n: int, threads: int) -> Callable[[], float] | None:
        """A function that runs one peer step and returns its duration, or None if the peer is unavailable."""
        if self.proc is None:
            return None
        cmd = {"op": "setup", "case": case, "n": n, "threads": threads, "lr": LR, "wd": WD}
        if self._request(cmd) is None:
            return None
        return lambda: float((self._request({"op": "step"}) or {"sec": float("nan")})["sec"])

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()


def _time_interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds per call of each fn, called round-robin after one warm-up call each."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            time.sleep(0.005)  # let the previous implementation's OpenMP threads stop spinning
            t = time.perf_counter()
            result = fn()
            elapsed = time.perf_counter() - t
            # A peer in another process reports its own step time (without the pipe round trip).
            times[name].append(result if isinstance(result, float) else elapsed)
    return {k: statistics.median(v) for k, v in times.items()}


def _probe_fns(n: int, threads: int) -> dict[str, Callable[[], object]]:
    """Floor probes for one row, timed interleaved with the row's implementations (see module docstring)."""
    from torch.utils.cpp_extension import load_inline

    probe = load_inline("slipstream_bench_rmw2", cpp_sources=_PROBE_SRC, functions=["rmw"],
                        extra_cflags=["-O3", "-fopenmp", "-march=native"], extra_ldflags=["-fopenmp"])
    p, g, m, v = (torch.rand(n) for _ in range(4))
    return {f"{_PROBE} {d}": (lambda d=d: probe.rmw(p, g, m, v, threads, d)) for d in (0, 256, 512)}


def _our_optimizers(p: torch.nn.Parameter, native: object, fallback: object, out: torch.Tensor | None
                    ) -> dict[str, Callable[[], object]]:
    from slipstream.ops.adam import DeepSpeedCPUAdam

    fns: dict[str, Callable[[], object]] = {}
    for name, op in (("slipstream native", native), ("slipstream fallback", fallback)):
        if op is None:
            continue
        opt = DeepSpeedCPUAdam([p], lr=LR, weight_decay=WD, adamw_mode=True)
        opt._op = op  # explicit implementation, whatever the builder picked for this process
        fns[name] = (lambda o=opt: o.step(low_precision_out=[out])) if out is not None else opt.step
    return fns


def _torch_optimizers(p: torch.nn.Parameter, out: torch.Tensor | None) -> dict[str, Callable[[], object]]:
    fns: dict[str, Callable[[], object]] = {}
    for cls in (torch.optim.Adam, torch.optim.AdamW):
        for impl in ("foreach", "fused"):
            if out is not None and (cls is torch.optim.Adam or impl == "foreach"):
                continue  # offload peers: the fastest torch update, then the cast
            wd = WD if cls is torch.optim.AdamW else 0.0
            opt = cls([p], lr=LR, weight_decay=wd, **{impl: True})
            name = f"torch {cls.__name__} {impl}" + (" + copy_" if out is not None else "")
            fns[name] = (lambda o=opt: (o.step(), out.copy_(p.detach()))) if out is not None else opt.step
    return fns


def _bench_config(n: int, threads: int, repeats: int, native: object, fallback: object, peer: _Peer,
                  floors: dict[tuple[str, int, int], float]) -> list[tuple]:
    rows = []
    for case in ("fp32", "bf16", "offload"):
        dtype = torch.bfloat16 if case == "bf16" else torch.float32
        p = torch.nn.Parameter(torch.randn(n).to(dtype))
        p.grad = (torch.randn(n) * 1e-3).to(dtype)
        out = torch.empty(n, dtype=torch.bfloat16) if case == "offload" else None
        fns = {**_our_optimizers(p, native, fallback, out), **_torch_optimizers(p, out),
               **_probe_fns(n, threads)}
        ds_name = "deepspeed DeepSpeedCPUAdam" + (" + copy_" if case == "offload" else "")
        peer_step = peer.setup(case, n, threads)
        if peer_step is not None:
            fns[ds_name] = peer_step
        rates = {k: n / sec for k, sec in _time_interleaved(fns, repeats).items() if sec == sec}
        del fns
        floor_gbs = max(rates.pop(k) for k in list(rates) if k.startswith(_PROBE)) * 28 / 1e9
        floors[(case, n, threads)] = floor_gbs
        floor = floor_gbs * 1e9 / BYTES_PER_PARAM[case]
        same_job = [v for k, v in rates.items() if not k.startswith("slipstream")
                    and not (case == "bf16" and k.startswith("torch"))]
        all_peers = [v for k, v in rates.items() if not k.startswith("slipstream")]
        for name, rate in rates.items():
            note = "bf16 states" if case == "bf16" and name.startswith("torch") else ""
            vs_same = rate / max(same_job) if same_job and name.startswith("slipstream") else None
            vs_all = rate / max(all_peers) if all_peers and name.startswith("slipstream") else None
            rows.append((case, n, threads, name, rate, rate / floor, vs_same, vs_all, note))
        if ds_name not in rates:
            rows.append((case, n, threads, ds_name, None, None, None, None, ""))
    return rows


def _fmt(rows: list[tuple], peer_note: str, floors: dict[tuple[str, int, int], float]) -> str:
    head = (f"{'case':8} {'params':>6} {'thr':>3}  {'implementation':36} {'Mparams/s':>9} {'% floor':>8} "
            f"{'vs peer':>8} {'vs any':>7}  note")
    lines = [head, "-" * len(head)]
    for case, n, threads, name, rate, frac, vs_same, vs_all, note in rows:
        size = f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"
        if rate is None:
            lines.append(f"{case:8} {size:>6} {threads:>3}  {name:36} {peer_note}")
            continue
        r = lambda x: f"{x:.2f}x" if x is not None else ""  # noqa: E731
        lines.append(f"{case:8} {size:>6} {threads:>3}  {name:36} {rate / 1e6:9.0f} {100 * frac:7.0f}% "
                     f"{r(vs_same):>8} {r(vs_all):>7}  {note}")
    lines.append("")
    for (case, n, threads), gbs in floors.items():
        lines.append(f"floor probe in the {case} {n / 1e6:.0f}M rows, {threads} thread(s): {gbs:.1f} GB/s -> "
                     f"{gbs * 1e3 / BYTES_PER_PARAM[case]:.0f} Mparams/s at {BYTES_PER_PARAM[case]} "
                     "bytes/param")
    lines.append("vs peer: ours / fastest peer doing the same job (torch, DeepSpeed; for bf16 only DeepSpeed "
                 "keeps fp32 states); vs any: ours / fastest peer of the row.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 1M params, 3 repeats")
    default_peer = ROOT / ".bench-venv" / "bin" / "python"
    parser.add_argument("--peer-python", default=str(default_peer) if default_peer.exists() else None,
                        help="python of a venv with deepspeed (default: .bench-venv/bin/python if present)")
    parser.add_argument("--sizes", default=None, help="comma-separated param counts (default 1e7,1e8)")
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    args = parser.parse_args()
    sizes = [int(float(s)) for s in (args.sizes or ("1e6" if args.quick else "1e7,1e8")).split(",")]
    thread_counts = [int(t) for t in args.threads.split(",")]
    repeats = {n: 3 if args.quick else (15 if n <= 2 * 10**7 else 5) for n in sizes}

    import slipstream.ops.fallback.cpu_adam as fallback
    from slipstream.ops.op_builder import CPUAdamBuilder

    try:
        native = CPUAdamBuilder().jit_load()
        level = native.simd_level()
    except Exception as exc:  # noqa: BLE001 - report and continue with the fallback only
        native, level = None, f"unavailable ({exc})"
    print(f"torch {torch.__version__}, {os.cpu_count()} cpus, native simd: {level}, "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    rows, floors = [], {}
    peer = _Peer(args.peer_python)
    try:
        for threads in thread_counts:
            torch.set_num_threads(threads)
            for n in sizes:
                rows += _bench_config(n, threads, repeats[n], native, fallback, peer, floors)
                print(f"... {n} params, {threads} thread(s) done", file=sys.stderr, flush=True)
    finally:
        peer.close()
    print(_fmt(rows, peer.note, floors))


if __name__ == "__main__":
    main()

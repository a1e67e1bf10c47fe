"""Benchmark of the async_io op: read and write GB/s of Slipstream's native op (each compiled engine), its
Python fallback and DeepSpeed's async_io op, against a dd-style sequential baseline on the same file system.

    python bench/aio.py [--quick] [--dir DIR] [--sizes 1,4,16,64,256] [--rounds 5] [--peer-python PY]

Every row moves one buffer of SIZE MiB to or from one file with the `aio` section's defaults (block_size
1 MiB, queue_depth 8, intra_op_parallelism 1, overlap_events true), one async call then wait():
- dd: `dd bs=1M oflag=direct` from /dev/zero / `dd bs=1M iflag=direct` to /dev/null (dd's own time), the
  file system's sequential O_DIRECT figure at queue depth 1;
- sequential into the buffer (run here and in DeepSpeed's process, on each one's buffers): dd's loop
  (1 MiB O_DIRECT preadv/pwritev, one at a time) on a page-aligned buffer of the transfer's size. dd moves every block through one reused 1 MiB buffer, which
  stays in the caches and TLBs; a 64 MiB tensor does not, and on some machines (virtual machines with
  emulated disks in particular) that alone costs a third of the read rate. This row is the baseline a
  tensor transfer can be held to; the target is checked against it, and "vs dd" is printed too. How fast
  a buffer fills also varies from one process (and allocation) to another on such machines, so each
  process's rows are compared with that process's own sequential row, and "met" for the target compares
  ours/sequential with DeepSpeed's/sequential;
- slipstream native <engine> / fallback / deepspeed: page-aligned buffers from new_cpu_locked_tensor
  (O_DIRECT straight from the buffer), new ones every round, shared by every row of this process (see
  `Buffers`; DeepSpeed's peer allocates its own the same way);
- rows marked "torch.empty": an ordinary tensor (not page-aligned). The native op copies it through
  aligned bounce buffers and still uses O_DIRECT, DeepSpeed through a full-size bounce buffer; the fallback
  falls back to plain (page-cache) I/O, so its row is not a device figure.
"write" goes to a new file (the old one is removed first), "rewrite" over the file just written (the steady
state of NVMe offload, where a swap file is rewritten every step; dd with conv=notrunc), "read" reads a file
written once by dd. All implementations of a size run in turn, round after round, starting each round at a
different one (interleaved, so load from other processes hits all alike); the table gives the median of the
rounds.

DeepSpeed runs in the peer venv (bench/make_peer_venv.sh; its async_io op needs libaio-dev to build) in a
subprocess that takes JSON requests on stdin and reports its own times.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch

MiB = 1 << 20
AIO = {"block_size": MiB, "queue_depth": 8, "single_submit": False, "overlap_events": True, "intra_op_parallelism": 1}
DD = "dd (sequential, O_DIRECT, qd 1)"
SEQ = "sequential into the buffer (qd 1)"
PEER_SEQ = "sequential into the buffer, deepspeed's process"

_PEER_SRC = r"""
import ctypes, json, os, sys, time, torch
from deepspeed.ops.op_builder import AsyncIOBuilder
module = AsyncIOBuilder().load(verbose=False)
print(json.dumps({"ready": True}), flush=True)
handle, buffers, round_ = None, {}, None
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["op"] == "setup":
        a = cmd["aio"]
        handle = module.aio_handle(a["block_size"], a["queue_depth"], a["single_submit"], a["overlap_events"],
                                   a["intra_op_parallelism"])
        print(json.dumps({"ok": True}), flush=True)
        continue
    if cmd["round"] != round_:
        buffers, round_ = {}, cmd["round"]  # new buffers every round, as on our side
    key = (cmd["nbytes"], cmd["locked"])
    if key not in buffers:
        n = cmd["nbytes"]
        buffers[key] = (handle.new_cpu_locked_tensor(n, torch.empty(0, dtype=torch.uint8)) if cmd["locked"]
                        else torch.ones(n, dtype=torch.uint8))
    if cmd["fresh"] and os.path.exists(cmd["path"]):
        os.unlink(cmd["path"])
    start = time.perf_counter()
    if cmd["op"] == "seq":  # bench/aio.py's _sequential, in this process's memory
        n, buf = cmd["nbytes"], buffers[key]
        view = memoryview((ctypes.c_char * n).from_address(buf.data_ptr())).cast("B")
        fd = os.open(cmd["path"], (os.O_WRONLY | os.O_CREAT if cmd["write"] else os.O_RDONLY) | os.O_DIRECT, 0o600)
        for pos in range(0, n, 1 << 20):
            (os.pwritev if cmd["write"] else os.preadv)(fd, [view[pos:pos + (1 << 20)]], pos)
        os.close(fd)
    else:
        (handle.async_pwrite if cmd["write"] else handle.async_pread)(buffers[key], cmd["path"], 0)
        handle.wait()
    print(json.dumps({"sec": time.perf_counter() - start}), flush=True)
"""


class _Peer:
    """DeepSpeed's async_io in its own venv, driven transfer by transfer so its timings interleave with ours."""

    def __init__(self, python: str | None) -> None:
        self.note = ""
        self.proc: subprocess.Popen[str] | None = None
        if not python or not Path(python).exists():
            self.note = f"not available (no peer python at {python}; run bench/make_peer_venv.sh)"
            return
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self.proc = subprocess.Popen([python, "-c", _PEER_SRC], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env, cwd="/")
        if self._request(None) is not None:
            self._request({"op": "setup", "aio": AIO})

    def _request(self, cmd: dict | None) -> dict | None:
        if self.proc is None or self.proc.stdin is None or self.proc.stdout is None:
            return None
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
            self.proc.kill()
            err = (self.proc.stderr.read() if self.proc.stderr else "").strip().splitlines()
            self.note = f"not available (peer failed: {(err[-1] if err else 'no output')[:160]})"
            self.proc = None
            return None

    def transfer(self, *, write: bool, fresh: bool, path: str, nbytes: int, locked: bool, pool: Buffers,
                 op: str = "io") -> float:
        answer = self._request({"op": op, "write": write, "fresh": fresh, "path": path, "nbytes": nbytes,
                                "locked": locked, "round": pool.round})
        return float(answer["sec"]) if answer else float("nan")

    def sequential(self, **kwargs: Any) -> float:
        return self.transfer(**kwargs, op="seq")

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()


def _dd(*, write: bool, fresh: bool, path: str, nbytes: int, locked: bool, pool: Buffers) -> float:
    """dd's own elapsed seconds for a sequential 1 MiB-block O_DIRECT copy."""
    count = f"count={max(1, nbytes // MiB)}"
    argv = (["dd", "if=/dev/zero", f"of={path}", "bs=1M", count, "oflag=direct", "conv=notrunc"] if write
            else ["dd", f"if={path}", "of=/dev/null", "bs=1M", count, "iflag=direct"])
    if fresh and os.path.exists(path):
        os.unlink(path)
    result = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"}, check=False)
    match = re.search(r"copied, ([0-9.e+-]+) s", result.stderr)
    if result.returncode != 0 or match is None:
        raise RuntimeError(f"{' '.join(argv)} failed: {result.stderr.strip()[-300:]}")
    return float(match.group(1))


class Buffers:
    """The buffers of one round, shared by every implementation in this process (DeepSpeed's peer makes its
    own the same way). On some machines the rate into a buffer depends on where its pages happen to land, so
    each round allocates new ones and every implementation of the round uses the same."""

    def __init__(self, allocate_locked: Callable[[int], torch.Tensor]) -> None:
        self.allocate_locked = allocate_locked
        self.round = 0
        self.tensors: dict[tuple[int, bool], torch.Tensor] = {}

    def next_round(self) -> None:
        self.round += 1
        self.tensors = {}

    def get(self, nbytes: int, locked: bool) -> torch.Tensor:
        key = (nbytes, locked)
        if key not in self.tensors:
            tensor = self.allocate_locked(nbytes) if locked else torch.empty(nbytes, dtype=torch.uint8)
            self.tensors[key] = tensor.fill_(1)
        return self.tensors[key]


def _sequential(*, write: bool, fresh: bool, path: str, nbytes: int, locked: bool, pool: Buffers) -> float:
    """dd's loop (1 MiB O_DIRECT blocks, one at a time) on this round's page-aligned buffer."""
    tensor = pool.get(nbytes, True)
    view = memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")
    if fresh and os.path.exists(path):
        os.unlink(path)
    flags = (os.O_WRONLY | os.O_CREAT if write else os.O_RDONLY) | os.O_DIRECT
    start = time.perf_counter()
    fd = os.open(path, flags, 0o600)
    try:
        for pos in range(0, nbytes, MiB):
            (os.pwritev if write else os.preadv)(fd, [view[pos:pos + MiB]], pos)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def _handle(module: Any, engine: str | None) -> Any:
    if engine is not None:
        os.environ["SLIPSTREAM_AIO_ENGINE"] = engine
    try:
        return module.aio_handle(*AIO.values())
    finally:
        os.environ.pop("SLIPSTREAM_AIO_ENGINE", None)


def _transfer_fn(handle: Any) -> Callable[..., float]:
    def run(*, write: bool, fresh: bool, path: str, nbytes: int, locked: bool, pool: Buffers) -> float:
        tensor = pool.get(nbytes, locked)
        if fresh and os.path.exists(path):
            os.unlink(path)
        start = time.perf_counter()
        (handle.async_pwrite if write else handle.async_pread)(tensor, path, 0)
        handle.wait()
        return time.perf_counter() - start
    return run


def _implementations(peer: _Peer) -> tuple[dict[str, tuple[Callable[..., float], bool]], Buffers]:
    """name -> (transfer function, page-aligned buffer?), and the buffer pool they share."""
    import slipstream.ops.fallback.async_io as fallback
    from slipstream.ops.op_builder import AsyncIOBuilder

    impls: dict[str, tuple[Callable[..., float], bool]] = {}
    try:
        native = AsyncIOBuilder().jit_load()
        engines = list(native.engines())
    except Exception as exc:  # noqa: BLE001 - report and go on with the fallback
        print(f"native async_io unavailable: {exc}", file=sys.stderr)
        native, engines = None, []
    for engine in engines:
        run = _transfer_fn(_handle(native, engine))
        impls[f"slipstream native {engine}"] = (run, True)
        if engine == engines[0]:
            impls[f"slipstream native {engine}, torch.empty"] = (run, False)
    fallback_handle = _handle(fallback, None)
    run = _transfer_fn(fallback_handle)
    impls["slipstream fallback"] = (run, True)
    impls["slipstream fallback, torch.empty (page cache)"] = (run, False)
    if peer.proc is not None:
        impls[PEER_SEQ] = (peer.sequential, True)
        impls["deepspeed async_io"] = (peer.transfer, True)
        impls["deepspeed async_io, torch.empty"] = (peer.transfer, False)
    allocator = _handle(native, None) if native is not None else fallback_handle
    example = torch.empty(0, dtype=torch.uint8)
    return impls, Buffers(lambda n: allocator.new_cpu_locked_tensor(n, example))


def _file_system(directory: Path) -> str:
    best = ("?", "?", "")
    with open("/proc/mounts") as mounts:
        for line in mounts:
            device, mount, fstype = line.split()[:3]
            if str(directory.resolve()).startswith(mount.rstrip("/") + "/") and len(mount) >= len(best[2]):
                best = (device, fstype, mount)
    return f"{best[0]} ({best[1]}) mounted on {best[2]}"


def _measure(directory: Path, sizes: list[int], rounds: int, peer: _Peer) -> dict[tuple[str, int, str], float]:
    impls, pool = _implementations(peer)
    secs: dict[tuple[str, int, str], list[float]] = {}
    for n in sizes:
        _dd(write=True, fresh=True, path=str(directory / f"read-{n}.bin"), nbytes=n * MiB, locked=True, pool=pool)
    for r in range(rounds):
        pool.next_round()
        for n in sizes:
            read_path = str(directory / f"read-{n}.bin")
            write_path = str(directory / f"write-{n}.bin")
            order = [(DD, (_dd, True)), (SEQ, (_sequential, True)), *impls.items()]
            shift = (r * len(sizes) + sizes.index(n)) % len(order)  # nobody is always first after dd's fork
            for name, (run, locked) in order[shift:] + order[:shift]:
                for what, write, fresh, path in (("write", True, True, write_path), ("rewrite", True, False, write_path),
                                                 ("read", False, False, read_path)):
                    sec = run(write=write, fresh=fresh, path=path, nbytes=n * MiB, locked=locked, pool=pool)
                    secs.setdefault((name, n, what), []).append(sec)
        print(f"... round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    return {k: n_bytes_gbs(k[1], statistics.median(v)) for k, v in secs.items()}


def n_bytes_gbs(size_mib: int, sec: float) -> float:
    return size_mib * MiB / sec / 1e9 if not math.isnan(sec) and sec > 0 else float("nan")


KINDS = ("write", "rewrite", "read")


def _ratios(gbs: dict[tuple[str, int, str], float], name: str, base: str, n: int) -> str:
    if (base, n, "write") not in gbs:
        return ""
    return "/".join(f"{gbs[(name, n, k)] / gbs[(base, n, k)]:.2f}" for k in KINDS)


def _table(gbs: dict[tuple[str, int, str], float], sizes: list[int], peer_note: str) -> str:
    names = list(dict.fromkeys(k[0] for k in gbs))
    head = (f"{'MiB':>4}  {'implementation':46} {'write':>6} {'rewrite':>7} {'read':>6}   "
            f"{'vs seq':>14} {'vs dd':>14} {'vs deepspeed':>14}")
    title = ("GB/s (median of the rounds); ratios are write/rewrite/read; 'vs seq' against the sequential "
             "baseline of the same process")
    lines = [title, head, "-" * len(head)]
    for n in sizes:
        for name in names:
            ds = "deepspeed async_io" + (", torch.empty" if "torch.empty" in name else "")
            vs_ds = _ratios(gbs, name, ds, n) if name.startswith("slipstream") else ""
            w, rw, r = (gbs[(name, n, k)] for k in KINDS)
            seq = PEER_SEQ if name.startswith("deepspeed") else SEQ
            lines.append(f"{n:>4}  {name:46} {w:6.2f} {rw:7.2f} {r:6.2f}   {_ratios(gbs, name, seq, n):>14} "
                         f"{_ratios(gbs, name, DD, n):>14} {vs_ds:>14}")
        lines.append("")
    if peer_note:
        lines.append(f"deepspeed async_io: {peer_note}")
    return "\n".join(lines)


def _verdict(gbs: dict[tuple[str, int, str], float], sizes: list[int], default: str | None) -> list[str]:
    """The issue's target for the engine a handle picks by default: >= 80% of sequential, >= DeepSpeed."""
    if default is None:
        return ["target: no native op to check"]
    out = []
    for n in [s for s in sizes if s >= 64]:
        for k in KINDS:
            ours = gbs[(default, n, k)]
            ds = gbs.get(("deepspeed async_io", n, k))
            vs_seq, vs_dd = ours / gbs[(SEQ, n, k)], ours / gbs[(DD, n, k)]
            ok = vs_seq >= 0.8
            vs_ds = ""
            if ds:
                ds_vs_seq = ds / gbs[(PEER_SEQ, n, k)]
                ok = ok and vs_seq >= ds_vs_seq
                vs_ds = f", {ours / ds:.2f}x deepspeed (deepspeed: {ds_vs_seq:.0%} of its sequential)"
            out.append(f"target {default} {n} MiB {k}: {vs_seq:.0%} of sequential into the buffer "
                       f"({vs_dd:.0%} of dd){vs_ds} -> {'met' if ok else 'NOT met'}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 1, 16 and 64 MiB, 2 rounds")
    parser.add_argument("--dir", default=None, help="directory on the file system to measure (default: TMPDIR or /tmp)")
    parser.add_argument("--sizes", default=None, help="comma-separated MiB (default 1,4,16,64,256)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per size (default 5; --quick 2)")
    default_peer = ROOT / ".bench-venv" / "bin" / "python"
    parser.add_argument("--peer-python", default=str(default_peer) if default_peer.exists() else None,
                        help="python of a venv with deepspeed (default: .bench-venv/bin/python if present)")
    args = parser.parse_args()
    sizes = [int(s) for s in (args.sizes or ("1,16,64" if args.quick else "1,4,16,64,256")).split(",")]
    rounds = args.rounds or (2 if args.quick else 5)
    directory = Path(tempfile.mkdtemp(prefix="slipstream-aio-bench-", dir=args.dir))
    print(f"file system: {_file_system(directory)}; directory {directory}; {os.cpu_count()} cpus, "
          f"load average {os.getloadavg()[0]:.1f}; aio {AIO}", flush=True)
    peer = _Peer(args.peer_python)
    try:
        gbs = _measure(directory, sizes, rounds, peer)
    finally:
        peer.close()
        shutil.rmtree(directory, ignore_errors=True)
    print(_table(gbs, sizes, peer.note))
    default = next((k[0] for k in gbs if k[0].startswith("slipstream native")), None)
    print("\n".join(_verdict(gbs, sizes, default)))


if __name__ == "__main__":
    main()

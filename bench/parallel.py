"""Benchmark of tensor and sequence parallelism: step time and peak memory per rank against one process,
DTensor TP and DeepSpeed (AutoTP, Ulysses).

    python bench/parallel.py [--quick] [--steps 6] [--peer-python .bench-venv/bin/python]

Rows (gloo on CPU, one thread per rank, 2 ranks; one fresh process group per row):
- TP: a tiny Llama (~21M parameters: vocab 8192, dim 512, 4 layers, 8 heads, MLP 1376), AdamW, batch 4 x 128.
  `single` (1 process, plain torch), `slipstream_tp2` (`tensor_parallel.autotp_size: 2`, ZeRO 0),
  `dtensor_tp2` (parallelize_module + torch AdamW, no engine), `deepspeed_autotp2` (peer environment).
- SP: one attention layer (8 heads x 64, seq 8192, causal SDPA), forward + backward. Each rank builds only its
  slice of the input sequence, the same rows as the single process's (`_sequence_rows`); the single process
  holds the whole sequence, as a user's would.
  `single`, `slipstream_sp2` (DistributedAttention), `slipstream_sp2_chunked` (`head_chunks` = one head per
  chunk, recomputed in backward), `deepspeed_sp2` (DeepSpeed's DistributedAttention).
Step time: median over the steps after one warmup. Memory: the peak RSS of the rank above its RSS before the
model was built (torch's own import is left out), the larger rank's. RSS also holds what glibc keeps of freed
blocks and one-time buffers of the kernels, so SP rows have a second column, `live`: the peak of the tensors
that the ops of one more step (run after time and RSS are read) create and still reference, counted by a
TorchDispatchMode; parameters and inputs made before that step, kernels' scratch buffers and the allocator's
retention are not in it (TP rows have none: DTensor runs its ops below the mode). Ratios are against `single`.
Targets (reported, not asserted): TP at DTensor's speed and memory; SP at DeepSpeed's speed with a per-rank
peak at most 0.6x the single process's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parent.parent

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

VOCAB, DIM, LAYERS, HEADS, MLP, BATCH, SEQ = 8192, 512, 4, 8, 1376, 4, 128


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.gate_proj, self.up_proj = nn.Linear(DIM, MLP, bias=False), nn.Linear(DIM, MLP, bias=False)
        self.down_proj = nn.Linear(MLP, DIM, bias=False)
        self.head_dim = DIM // HEADS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.input_layernorm(x)
        q, k, v = (p(h).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        x = x + self.o_proj(y)
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class TinyLlamaModel(nn.Module):  # DeepSpeed's AutoTP reads the family from a class name ending in Model
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed_tokens = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for block in self.layers:
            x = block(x)
        return self.lm_head(self.norm(x))


def _live_tensor_bytes() -> Any:
    """slipstream/profiling/live_tensors.py's counter, loaded from its file (it imports torch only): the DeepSpeed
    rows run in the peer environment, where the slipstream package must not be imported."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_live_tensors", ROOT / "slipstream" / "profiling" / "live_tensors.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.LiveTensorBytes()


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _current_rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _tp_stepper(row: str) -> Any:
    model = TinyLlamaModel()
    config = {
        "train_batch_size": BATCH,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "gradient_clipping": 1.0,
        "steps_per_print": 10**6,
        "tensor_parallel": {"autotp_size": 2},
    }
    if row == "single" or row == "dtensor_tp2":
        if row == "dtensor_tp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import Replicate
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            mesh = init_device_mesh("cpu", (2,))
            plan: dict[str, Any] = {
                "embed_tokens": RowwiseParallel(input_layouts=Replicate()),
                "lm_head": ColwiseParallel(output_layouts=Replicate()),
            }
            for i in range(LAYERS):
                plan |= {
                    f"layers.{i}.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
                }
                plan |= {f"layers.{i}.{n}": RowwiseParallel() for n in ("o_proj", "down_proj")}
                model.layers[i].head_dim = DIM // HEADS
            parallelize_module(model, mesh, plan)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)

        def step(x: torch.Tensor, y: torch.Tensor) -> float:
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            return float(loss)

        return step
    if row == "slipstream_tp2":
        sys.path.insert(0, str(ROOT))
        import slipstream as engine_lib
    else:
        import logging

        import deepspeed as engine_lib

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    engine, *_ = engine_lib.initialize(model=model, model_parameters=model.parameters(), config=config)

    def engine_step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = F.cross_entropy(engine(x).flatten(0, 1), y.flatten())
        engine.backward(loss)
        engine.step()
        return float(loss)

    return engine_step


def _sequence_rows(start: int, end: int, width: int) -> torch.Tensor:
    """Rows [start, end) of the SP rows' input sequence [1, seq, width], made without the others: every block of
    256 rows has its own seed, so the single process's whole sequence is the ranks' slices put together (a
    rank builds only its slice, as it would get only its slice from the loader adapter). One block at a time
    is the only temporary."""
    block = 256
    x = torch.empty(1, end - start, width)
    for first in range(start - start % block, end, block):
        rows = torch.randn(1, block, width, generator=torch.Generator().manual_seed(1000 + first // block))
        lo, hi = max(first, start), min(first + block, end)
        x[:, lo - start : hi - start] = rows[:, lo - first : hi - first]
    return x


def _sp_stepper(row: str, seq: int) -> Any:
    """One attention layer as a model has it: x -> q, k, v projections -> attention -> output projection."""
    heads, head_dim = 8, 64
    width = heads * head_dim
    local = seq // dist.get_world_size()
    torch.manual_seed(0)
    qkv, out_proj = nn.Linear(width, 3 * width, bias=False), nn.Linear(width, width, bias=False)
    start = dist.get_rank() * local
    x = _sequence_rows(start, start + local, width).requires_grad_()

    def local_attention(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        qh, kh, vh = (t.transpose(1, 2) for t in (a, b, c))
        return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True).transpose(1, 2)

    attend: Any = local_attention
    extra: tuple[Any, ...] = ()
    if row.startswith("slipstream_sp2"):
        sys.path.insert(0, str(ROOT))
        from slipstream.sequence.layer import DistributedAttention

        chunks = heads // dist.get_world_size() if row == "slipstream_sp2_chunked" else None
        attend = DistributedAttention(local_attention, dist.group.WORLD, 2, 1, head_chunks=chunks)
    elif row == "deepspeed_sp2":
        import deepspeed
        from deepspeed.sequence.layer import DistributedAttention as DeepSpeedAttention

        deepspeed.init_distributed(dist_backend="gloo")
        attend = DeepSpeedAttention(local_attention, dist.group.WORLD, scatter_idx=2, gather_idx=1)
        extra = (0,)  # batch_dim_idx

    def layer(h: torch.Tensor) -> torch.Tensor:
        # a model's attention layer: q, k and v are its locals, released when it returns (autograd keeps what
        # the attention saves for its backward, in every row alike)
        q, k, v = qkv(h).view(1, local, 3, heads, head_dim).unbind(2)
        y = attend(q, k, v, *extra)
        return out_proj(y.reshape(1, local, width))

    def step(*_: Any) -> float:
        layer(x).sum().backward()
        for t in (x, qkv.weight, out_proj.weight):
            t.grad = None
        return 0.0

    return step


def rank_main(rank: int, world: int, store_dir: str, kind: str, row: str, steps: int, seq: int, out: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(store_dir, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT="29999"
    )
    base = _current_rss_mib()
    step = _tp_stepper(row) if kind == "tp" else _sp_stepper(row, seq)
    times = []
    for i in range(steps + 1):
        dist.barrier()
        started = time.perf_counter()
        step(*_batch(i))
        times.append(time.perf_counter() - started)
    result = {"time_s": statistics.median(times[1:]), "peak_mib": _rss_mib() - base, "live_mib": None}
    if kind == "sp":  # one more step, after time and RSS are read, counts the live tensors (plain tensors only)
        dist.barrier()
        with _live_tensor_bytes() as live:
            step(*_batch(steps + 1))
        result["live_mib"] = live.peak / 2**20
    Path(out, f"{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def run_row(python: str, kind: str, row: str, steps: int, seq: int) -> dict[str, float] | None:
    world = 1 if row == "single" else 2
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            subprocess.Popen(
                [python, __file__, "--rank", str(r), str(world), tmp, kind, row, str(steps), str(seq)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(world)
        ]
        errors = [p.communicate()[1] for p in procs]
        if any(p.returncode for p in procs):
            print(f"  {kind}/{row}: failed: {errors[0].strip().splitlines()[-1:] if errors[0] else '?'}")
            return None
        results = [json.loads(Path(tmp, f"{r}.json").read_text()) for r in range(world)]
    live = [r["live_mib"] for r in results if r["live_mib"] is not None]
    return {"time_s": max(r["time_s"] for r in results), "peak_mib": max(r["peak_mib"] for r in results)} | (
        {"live_mib": max(live)} if live else {}
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--quick", action="store_true", help="2 steps, seq 2048")
    parser.add_argument("--peer-python", default=str(ROOT / ".bench-venv/bin/python"))
    parser.add_argument("--only", choices=("tp", "sp"), default=None)
    parser.add_argument("--rows", default="", help="comma-separated row names (default: all)")
    args = parser.parse_args()
    steps, seq = (2, 2048) if args.quick else (args.steps, args.seq)
    peer = args.peer_python if Path(args.peer_python).exists() else None
    rows = {
        "tp": ["single", "slipstream_tp2", "dtensor_tp2", "deepspeed_autotp2"],
        "sp": ["single", "slipstream_sp2", "slipstream_sp2_chunked", "deepspeed_sp2"],
    }
    for kind, names in rows.items():
        if args.only not in (None, kind):
            continue
        print(f"{kind.upper()} ({'tiny Llama, batch 4 x 128' if kind == 'tp' else f'attention, seq {seq}, 8 heads'})")
        live_head = f"{'live MiB/rank':>15}{'x single':>10}" if kind == "sp" else ""
        print(f"  {'row':<24}{'step s':>10}{'x single':>10}{'peak MiB/rank':>15}{'x single':>10}{live_head}")
        single = None
        for name in names:
            if args.rows and name not in args.rows.split(",") and name != "single":
                continue
            python = peer if name.startswith("deepspeed") else sys.executable
            if python is None:
                print(f"  {name:<24} skipped: no peer environment (bash bench/make_peer_venv.sh)")
                continue
            got = run_row(python, kind, name, steps, seq)
            if got is None:
                continue
            single = single or got
            print(
                f"  {name:<24}{got['time_s']:>10.3f}{got['time_s'] / single['time_s']:>10.2f}"
                f"{got['peak_mib']:>15.0f}{got['peak_mib'] / max(single['peak_mib'], 1e-9):>10.2f}"
                + (
                    f"{got['live_mib']:>15.0f}{got['live_mib'] / max(single['live_mib'], 1e-9):>10.2f}"
                    if "live_mib" in got
                    else ""
                )
            )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        r, w, d, k, row, s, q = sys.argv[2:9]
        rank_main(int(r), int(w), d, k, row, int(s), int(q), d)
    else:
        main()

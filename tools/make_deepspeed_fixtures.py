"""Generate the DeepSpeed 0.19 checkpoint fixtures under tests/fixtures/deepspeed_ckpt/.

Run it once with the peer environment (the only place DeepSpeed is installed):

    .bench-venv/bin/python tools/make_deepspeed_fixtures.py [--universal]

`--universal` also runs DeepSpeed's `ds_to_universal` on two of the cases, into tests/fixtures/deepspeed_universal/.

Each case trains a tiny fixed model for two AdamW steps with real DeepSpeed on CPU/gloo, saves a checkpoint and
writes `expected.json` next to it: DeepSpeed's own view of the final weights (the gathered module weights, the fp32
master weights and the Adam moments), as flat float lists, so the tests never unpickle anything of ours. The copies
of DeepSpeed's zero_to_fp32.py / zero_to_torch.py that save_checkpoint drops are removed (they are DeepSpeed's code).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "deepspeed_ckpt"

# name -> (zero stage, world size, dtype). Every model has a frozen parameter except stage0_bf16's: at stage 0
# DeepSpeed's bf16 wrapper (FP16_UnfusedOptimizer) keeps fp32 masters for trainable parameters only and the file
# does not say which parameters were frozen, so masters cannot be matched to names there (a documented gap).
CASES: dict[str, tuple[int, int, str]] = {
    "stage0_fp32_ws1": (0, 1, "fp32"),
    "stage0_bf16_ws2": (0, 2, "bf16"),
    "stage1_fp32_ws2": (1, 2, "fp32"),
    "stage2_fp32_ws2": (2, 2, "fp32"),
    "stage3_fp32_ws2": (3, 2, "fp32"),
    "stage2_bf16_ws2": (2, 2, "bf16"),
    "stage3_bf16_ws2": (3, 2, "bf16"),
}
NUM_STEPS = 2
MICRO_BATCH = 2


class TinyNet(torch.nn.Module):
    """Linear(8,16) -> LayerNorm -> ReLU -> Linear(16,3), a buffer and a frozen 5-element parameter (as LoRA-style
    fine-tuning has). 227 trainable elements (odd, so every flat partition and every stage-3 per-parameter split
    carries padding)."""

    def __init__(self, *, with_frozen: bool) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.fc2 = torch.nn.Linear(16, 3)
        self.register_buffer("out_scale", torch.tensor([1.0, 0.5, 2.0]))
        frozen = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 5), requires_grad=False)
        self.frozen_bias = frozen if with_frozen else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc2(torch.relu(self.norm(self.fc1(x)))) * self.out_scale
        return out if self.frozen_bias is None else out + self.frozen_bias[:3]


def _ds_config(stage: int, dtype: str, world_size: int) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "train_batch_size": MICRO_BATCH * world_size,
        "zero_optimization": {"stage": stage},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                     "warmup_num_steps": 4}},
        "steps_per_print": 1000,
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def _flat(t: torch.Tensor) -> list[float]:
    return [float(v) for v in t.detach().float().reshape(-1).tolist()]


def _expected(engine: Any, stage: int) -> dict[str, Any]:
    """Gather DeepSpeed's own full view of module weights, fp32 masters and Adam moments on every rank."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    module, master, exp_avg, exp_avg_sq = {}, {}, {}, {}
    named = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in named], enabled=stage == 3):
        for name, p in named:
            module[name] = _flat(p.data)
    for name, buf in engine.module.named_buffers():
        module[name] = _flat(buf)
    # Stage 0 keeps whole fp32 masters: the params themselves (fp32), or FP16_UnfusedOptimizer.fp32_groups (bf16).
    wrapped = stage == 0 and hasattr(engine.optimizer, "fp32_groups")
    masters = [m for group in engine.optimizer.fp32_groups for m in group] if wrapped else [p for _, p in named]
    if len(masters) != len(named):
        raise RuntimeError(f"{len(masters)} fp32 masters for {len(named)} parameters; cannot pair them by order")
    base = engine.optimizer.optimizer if wrapped else engine.optimizer
    for (name, p), fp32 in zip(named, masters):
        if stage == 0:
            master[name] = _flat(fp32.data)
            state = base.state.get(fp32)
            if state:
                exp_avg[name], exp_avg_sq[name] = _flat(state["exp_avg"]), _flat(state["exp_avg_sq"])
        elif p.requires_grad:  # ZeRO keeps no master or moments for frozen parameters
            master[name] = _flat(safe_get_full_fp32_param(p))
            exp_avg[name] = _flat(safe_get_full_optimizer_state(p, "exp_avg"))
            exp_avg_sq[name] = _flat(safe_get_full_optimizer_state(p, "exp_avg_sq"))
    return {"module": module, "master": master, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq,
            "global_steps": engine.global_steps}


def _run_case(rank: int, name: str, stage: int, world_size: int, dtype: str, port: int) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       "DS_ACCELERATOR": "cpu"})
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = TinyNet(with_frozen=(stage, dtype) != (0, "bf16"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    config = _ds_config(stage, dtype, world_size)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    gen = torch.Generator().manual_seed(1234)
    low = torch.bfloat16 if dtype == "bf16" else torch.float32
    for _ in range(NUM_STEPS):
        x = torch.randn(world_size, MICRO_BATCH, 8, generator=gen)[rank].to(low)
        y = torch.randn(world_size, MICRO_BATCH, 3, generator=gen)[rank].to(low)
        loss = torch.nn.functional.mse_loss(engine(x).float(), y.float())
        engine.backward(loss)
        engine.step()
    case_dir = OUT / name
    engine.save_checkpoint(str(case_dir), client_state={"epoch": 3})
    expected = _expected(engine, stage)
    if rank == 0:
        expected.update({"zero_stage": stage, "world_size": world_size, "dtype": dtype,
                         "tag": f"global_step{NUM_STEPS}", "client_state": {"epoch": 3}})
        (case_dir / "expected.json").write_text(json.dumps(expected, indent=0, sort_keys=True) + "\n")
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):
            (case_dir / script).unlink(missing_ok=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


UNIVERSAL_OUT = OUT.parent / "deepspeed_universal"
UNIVERSAL_CASES = ("stage2_bf16_ws2", "stage3_fp32_ws2")  # the dict form with step.pt, and the flat stage-3 form


def _make_universal(name: str) -> None:
    """DeepSpeed's own ds_to_universal on a case's checkpoint, into tests/fixtures/deepspeed_universal/<name>/
    (`--inject_missing_state`: the model is not Megatron's, so the checkpoint has no universal_checkpoint_info)."""
    import subprocess
    import sys

    target = UNIVERSAL_OUT / name
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    subprocess.run(
        [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(OUT / name / "global_step2"),
         "--output_folder", str(target / "global_step2_universal"), "--num_extract_workers", "1",
         "--num_merge_workers", "1", "--inject_missing_state"],
        check=True,
    )
    (target / "latest_universal").write_text("global_step2_universal")
    for script in target.rglob("*.py"):
        script.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", default=list(CASES), help=f"subset of {list(CASES)}")
    parser.add_argument("--universal", action="store_true",
                        help=f"also convert {list(UNIVERSAL_CASES)} with DeepSpeed's ds_to_universal")
    args = parser.parse_args()
    os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for name in args.cases:
        stage, world_size, dtype = CASES[name]
        shutil.rmtree(OUT / name, ignore_errors=True)
        mp.start_processes(_run_case, args=(name, stage, world_size, dtype, _free_port()), nprocs=world_size,
                           start_method="spawn")
        size = sum(p.stat().st_size for p in (OUT / name).rglob("*") if p.is_file())
        print(f"{name}: {size} bytes")
    if args.universal:
        for name in UNIVERSAL_CASES:
            _make_universal(name)


if __name__ == "__main__":
    main()

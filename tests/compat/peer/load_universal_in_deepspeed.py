"""Run by tests/compat/test_universal_checkpoint.py with the DeepSpeed peer interpreter (never imported by
Slipstream's tests): real DeepSpeed loads a universal checkpoint that Slipstream wrote, with
`checkpoint.load_universal`, at the ZeRO stage and world size given, and prints as JSON whether every fp32 master
and exp_avg equals the expected values saved next to it.

    PEER_PYTHON load_universal_in_deepspeed.py SAVE_DIR EXPECTED_PT STAGE WORLD
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.multiprocessing as mp


class TinyNet(torch.nn.Module):
    """tests/compat/test_checkpoint_single.py's TinyNet (this file cannot import Slipstream's tests)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.fc2 = torch.nn.Linear(16, 3)
        self.register_buffer("out_scale", torch.tensor([1.0, 0.5, 2.0]))
        self.frozen_bias = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 5), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.norm(self.fc1(x)))) * self.out_scale + self.frozen_bias[:3]


def _rank(rank: int, world: int, store: str, save_dir: str, expected_path: str, stage: int, out: str) -> None:
    env = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": world}
    os.environ.update({k: str(v) for k, v in env.items()}, DS_ACCELERATOR="cpu")
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    # a file store, not a TCP port: no port can be taken by another job between choosing it and binding it;
    # DeepSpeed's init_distributed then finds the group initialised
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    deepspeed.init_distributed(dist_backend="gloo")
    model = TinyNet()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": stage},
        "checkpoint": {"load_universal": True},
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    path, _ = engine.load_checkpoint(save_dir)
    expected = torch.load(expected_path)
    differ = []
    for name, param in engine.module.named_parameters():
        if not param.requires_grad:
            continue
        master = safe_get_full_fp32_param(param).float().reshape(-1)
        exp_avg = safe_get_full_optimizer_state(param, "exp_avg").float().reshape(-1)
        if not torch.equal(master, expected[name]["master"].reshape(-1)):
            differ.append(f"{name} master")
        if not torch.equal(exp_avg, expected[name]["exp_avg"].reshape(-1)):
            differ.append(f"{name} exp_avg")
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"path": path, "global_steps": engine.global_steps, "differ": differ}, f)
    torch.distributed.barrier()  # no rank leaves while another still uses the group (gloo aborts at exit)
    torch.distributed.destroy_process_group()


def main() -> None:
    save_dir, expected_path, stage, world = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    store = os.path.join(save_dir, f"deepspeed_store_{stage}_{world}")
    out = os.path.join(save_dir, "deepspeed_result.json")
    mp.start_processes(
        _rank, args=(world, store, save_dir, expected_path, stage, out), nprocs=world, start_method="spawn"
    )
    print(open(out).read())


if __name__ == "__main__":
    main()

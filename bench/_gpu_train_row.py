"""One row of bench/gpu_train.py in its own process: a Llama-style decoder trained a few steps by one framework.

    python bench/_gpu_train_row.py SPEC_JSON

Runs under Slipstream's environment or (for the DeepSpeed rows) the peer's, so it imports neither framework at
the top and nothing of slipstream but through `import slipstream as ds`. Prints one line `@@gpu_train {json}`:
the status ("ok", "not available" with the reason) and the figures the driver tabulates. The model, the rows'
configs and the FLOP count live here, so the driver and the worker cannot disagree about them.
"""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

MARK = "@@gpu_train "

# row -> (zero_optimization section, activation checkpointing, engine.compile())
ROWS: dict[str, tuple[dict[str, Any], bool, bool]] = {
    "zero0": ({"stage": 0}, False, False),
    "zero2": ({"stage": 2}, False, False),
    "zero3": ({"stage": 3}, False, False),
    "zero3_ckpt": ({"stage": 3}, True, False),
    "zero3_offload_opt": ({"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True}}, False, False),
    "zero3_offload_all": (
        {
            "stage": 3,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "cpu", "pin_memory": True},
        },
        False,
        False,
    ),
    "zero3_compile": ({"stage": 3}, False, True),
}


class NotAvailable(Exception):
    """The framework lacks what the row needs (the row is reported as not available, not as failed)."""


def ds_config(row: str, spec: dict[str, Any]) -> dict[str, Any]:
    """The DeepSpeed JSON both frameworks get for `row`."""
    zero, checkpointing, _ = ROWS[row]
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": spec["batch"],
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
    }
    if checkpointing:
        config["activation_checkpointing"] = {"partition_activations": False}
    return config


def ffn_width(width: int) -> int:
    """Llama's SwiGLU width: 8/3 of the model width, rounded up to a multiple of 256."""
    return 256 * math.ceil(8 * width / 3 / 256)


def flops_per_token(params: int, spec: dict[str, Any]) -> float:
    """Model FLOPs per trained token: 6 N (the matmuls, forward and backward; the embedding lookup is not a
    matmul, so its parameters are left out) plus the attention scores, 12 x layers x width x seq (PaLM's count,
    no causal halving)."""
    matmul_params = params - spec["vocab"] * spec["width"]
    return 6.0 * matmul_params + 12.0 * spec["layers"] * spec["width"] * spec["seq"]


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(width, eps=1e-5), nn.RMSNorm(width, eps=1e-5)
        self.qkv, self.out = nn.Linear(width, 3 * width, bias=False), nn.Linear(width, width, bias=False)
        hidden = ffn_width(width)
        self.gate_up, self.down = nn.Linear(width, 2 * hidden, bias=False), nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, w)
        x = x + self.out(attn)
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = t.shape[-1] // 2
    t1, t2 = t[..., :half], t[..., half:]
    return torch.cat((t1 * cos - t2 * sin, t2 * cos + t1 * sin), dim=-1)


class Llama(nn.Module):
    """A Llama-style decoder (RMSNorm, rotary positions, SwiGLU, untied head) built from its dimensions."""

    def __init__(self, spec: dict[str, Any], checkpoint: Callable[..., torch.Tensor] | None = None) -> None:
        super().__init__()
        width, heads = spec["width"], spec["heads"]
        self.embed = nn.Embedding(spec["vocab"], width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(spec["layers"]))
        self.norm = nn.RMSNorm(width, eps=1e-5)
        self.head = nn.Linear(width, spec["vocab"], bias=False)
        self.checkpoint = checkpoint
        inv = 1.0 / (10000 ** (torch.arange(0, width // heads, 2).float() / (width // heads)))
        angles = torch.outer(torch.arange(spec["seq"]).float(), inv)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        cos, sin = self.cos.to(x.dtype), self.sin.to(x.dtype)
        for block in self.blocks:
            x = self.checkpoint(block, x, cos, sin) if self.checkpoint else block(x, cos, sin)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def _init_process_group(dry_run: bool) -> None:
    import torch.distributed as dist

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend = "gloo" if dry_run or not torch.cuda.is_available() else "nccl"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def _build(spec: dict[str, Any], row: str, ds: Any, accel: Any) -> tuple[Any, int]:
    _, checkpointing, compiled = ROWS[row]
    torch.manual_seed(1234)
    on_device = "offload_param" not in ROWS[row][0] and not spec["dry_run"]
    with torch.device(accel.current_device_name() if on_device else "cpu"):
        model = Llama(spec, ds.checkpointing.checkpoint if checkpointing else None).to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    config = ds_config(row, spec)
    offloads_optimizer = "offload_optimizer" in config["zero_optimization"]
    if ds.__name__ == "deepspeed" and not spec["dry_run"] and not offloads_optimizer and shutil.which("nvcc") is None:
        config["optimizer"]["params"]["torch_adam"] = True  # its FusedAdam is built by nvcc at first use
    engine, _, _, _ = ds.initialize(model=model, model_parameters=model.parameters(), config=config)
    if compiled:
        if not callable(getattr(engine, "compile", None)):
            raise NotAvailable(f"{ds.__name__} {ds.__version__} has no engine.compile()")
        if spec["dry_run"]:
            engine.compile(backend="eager")  # inductor on a CPU: minutes of C++
        else:
            engine.compile()
    return engine, params


def _step(engine: Any, accel: Any, tokens: torch.Tensor, labels: torch.Tensor) -> tuple[float, float, float, float]:
    """One step, timed by phase with a device synchronise between phases: (forward, backward, optimizer) seconds
    and the loss."""
    accel.synchronize()
    start = time.perf_counter()
    loss = engine(tokens, labels)
    accel.synchronize()
    forward = time.perf_counter()
    engine.backward(loss)
    accel.synchronize()
    backward = time.perf_counter()
    engine.step()
    accel.synchronize()
    end = time.perf_counter()
    return forward - start, backward - forward, end - backward, float(loss.detach())


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Build, train `warmup` + `steps` steps, measure the timed steps; the figures the driver tabulates."""
    import torch.distributed as dist

    _init_process_group(spec["dry_run"])
    try:
        return _train(spec)
    finally:
        dist.destroy_process_group()


def _train(spec: dict[str, Any]) -> dict[str, Any]:
    framework, row = spec["framework"], spec["row"]
    if framework == "deepspeed":
        import logging

        import deepspeed as ds  # type: ignore[import-not-found]

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    else:
        import slipstream as ds
    accel = ds.accelerator.get_accelerator()
    accel.reset_peak_memory_stats()
    started = time.perf_counter()
    engine, params = _build(spec, row, ds, accel)
    generator = torch.Generator().manual_seed(99)
    shape = (spec["batch"], spec["seq"])
    timed: list[tuple[float, float, float, float]] = []
    for index in range(spec["warmup"] + spec["steps"]):
        tokens = torch.randint(0, spec["vocab"], shape, generator=generator).to(accel.current_device_name())
        figures = _step(engine, accel, tokens, tokens.roll(-1, dims=1))
        if index >= spec["warmup"]:
            timed.append(figures)
    fwd, bwd, opt = (sum(t[i] for t in timed) / len(timed) for i in range(3))
    return {
        "status": "ok",
        "version": ds.__version__,
        "device": accel.device_name() if spec["dry_run"] else torch.cuda.get_device_name(),
        "params": params,
        "step_s": fwd + bwd + opt,
        "forward_s": fwd,
        "backward_s": bwd,
        "optimizer_s": opt,
        "tokens_per_s": spec["batch"] * spec["seq"] / (fwd + bwd + opt),
        "flops_per_token": flops_per_token(params, spec),
        "peak_device_bytes": accel.max_memory_allocated(),
        "peak_host_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "last_loss": timed[-1][3],
        "setup_s": time.perf_counter() - started - sum(sum(t[:3]) for t in timed),
    }


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        sys.exit(__doc__)
    spec = json.loads(argv[1])
    if spec["dry_run"]:
        torch.set_num_threads(1)
    try:
        result = run(spec)
    except NotAvailable as missing:
        result = {"status": "not available", "reason": str(missing)}
    print(MARK + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv)

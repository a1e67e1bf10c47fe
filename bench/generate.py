"""Benchmark of generation and of the weight hand-off: tokens per second of greedy `generate` and GB/s of
`iter_full_weights`, as ratios in one run.

    python bench/generate.py [--quick] [--rounds 3] [--new-tokens 64] [--rows ...] [--peer-python PY]

The model: a tiny Hugging Face Llama built offline from a `LlamaConfig` (vocab 2048, width 256, 4 layers, 8
heads, 4 KV heads, MLP 688; 4.2M parameters, fp32), the same seed in every row. Greedy `generate`, batch 4,
a 16-token prompt, `--new-tokens` new tokens (64), the model's own KV cache. gloo on CPU, one thread per rank;
every row is a fresh process (two ranks, or one for `unsharded`):
- `unsharded`: the plain model's `generate` in one process (the reference of the hybrid rows);
- `unsharded_x2`: the same on each of two ranks at once (what the two ZeRO-3 ranks' compute costs when they
  share the machine's cores, without any gather);
- `zero3_hybrid`: a ZeRO-3 engine with `hybrid_engine.enabled`, `engine.eval(); engine.generate(...)`: every
  unit gathered once per call;
- `zero3_hybrid_tp2`: the same with `hybrid_engine.inference_tp_size: 2`: the two ranks are one generation
  group; every call refills each rank's half of every layer (a unit gathered at a time up to
  `tp_gather_partition_size`), gathers both ranks' prompts (batch 8) and generates them once over the group,
  an all-reduce per row-parallel layer and token; each rank gets its 4 rows back;
- `zero3_naive`: the same engine without the hybrid engine: the module hooks gather every layer again for every token (what
  `engine.generate` / `engine.module.generate` does at ZeRO-3 without the hybrid engine; both ZeRO-3 rows keep
  DeepSpeed's default `stage3_param_persistence_threshold`, so the final norm stays whole, as a user's would);
- `ss_tp2`: `slipstream.init_inference(tensor_parallel={"tp_size": 2})`, fp32;
- `ds_tp2`: DeepSpeed's `init_inference` with the same arguments (AutoTP, no kernel injection), run with the
  peer environment's Python; skipped with its error when it fails;
- `weights`: at ZeRO-3, GB/s of whole parameters handed out by `iter_full_weights()` against one plain
  gather of the whole model (`GatheredParameters` over every parameter) and a copy of its `state_dict()`.
- `lora_fused` / `lora_unfused`: a PEFT LoRA (rank 16 on every projection) of the same model in a ZeRO-1 engine
  on two ranks, `engine.generate` with the hybrid engine (the deltas fused for the call) and without it (every
  forward computes the LoRA path); compared with each other, not with `unsharded`.
Times: median over `--rounds` after one warm-up call, wall-clock and the CPU seconds of rank 0's process (on a
machine shared with other jobs the CPU time says what a row costs, the wall time also how long it waited). All rows must give the same tokens (printed).
Targets (reported, not asserted): hybrid >= 5x the naive ZeRO-3 tokens/s and within 1.3x of `unsharded`.
Nothing here imports slipstream at module level: the DeepSpeed row runs this file in `.bench-venv`.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parent.parent

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

VOCAB, WIDTH, LAYERS, HEADS, KV_HEADS, MLP, BATCH, PROMPT = 2048, 256, 4, 8, 4, 688, 4, 16
ROWS = (
    "unsharded",
    "unsharded_x2",
    "zero3_hybrid",
    "zero3_hybrid_tp2",
    "zero3_naive",
    "ss_tp2",
    "ds_tp2",
    "weights",
    "lora_fused",
    "lora_unfused",
)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=WIDTH,
        intermediate_size=MLP,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=256,
        pad_token_id=0,
        eos_token_id=None,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def _prompt() -> torch.Tensor:
    return torch.randint(1, VOCAB, (BATCH, PROMPT), generator=torch.Generator().manual_seed(1))


def _timed(call: Callable[[], Any], rounds: int) -> tuple[float, Any, float]:
    """Median seconds of `call()` over `rounds` after one warm-up; its last result; the median CPU seconds this
    process spent in it (what the call costs whatever else runs on the machine)."""
    out, times, cpu = call(), [], []
    for _ in range(rounds):
        if dist.is_initialized():
            dist.barrier()
        started, cpu_started = time.perf_counter(), time.process_time()
        out = call()
        times.append(time.perf_counter() - started)
        cpu.append(time.process_time() - cpu_started)
    return statistics.median(times), out, statistics.median(cpu)


def _zero3_engine(hybrid: bool, tp: int = 1) -> Any:
    import slipstream

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3},  # DeepSpeed's persistence threshold (1e5): what a user gets
        "hybrid_engine": {"enabled": hybrid, "inference_tp_size": tp},
        "steps_per_print": 10**6,
    }
    engine, *_ = slipstream.initialize(model=make_llama(), config=config)
    engine.eval()
    return engine


def _lora_engine(fused: bool) -> Any:
    """A PEFT LoRA (rank 16 on every projection) of the Llama in a ZeRO-1 engine: with the hybrid engine its
    generate runs with the deltas fused into the base weights, without it every forward computes the LoRA path."""
    from peft import LoraConfig, get_peft_model

    import slipstream

    model = make_llama()
    lora = LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS, init_lora_weights=False)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 1},
        "hybrid_engine": {"enabled": fused},
        "steps_per_print": 10**6,
    }
    engine, *_ = slipstream.initialize(model=get_peft_model(model, lora), config=config)
    engine.eval()
    return engine


def _inference_engine(row: str) -> Any:
    if row == "ds_tp2":
        import logging

        import deepspeed as lib

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    else:
        sys.path.insert(0, str(ROOT))
        import slipstream as lib
    return lib.init_inference(
        make_llama(), dtype=torch.float32, tensor_parallel={"tp_size": 2}, replace_with_kernel_inject=False
    )


def _generation_row(row: str, new_tokens: int, rounds: int) -> dict[str, Any]:
    if row.startswith("unsharded"):
        generator = make_llama()
    elif row.startswith("zero3"):
        generator = _zero3_engine(row.startswith("zero3_hybrid"), tp=2 if row.endswith("tp2") else 1)
    elif row.startswith("lora"):
        generator = _lora_engine(row == "lora_fused")
    else:
        generator = _inference_engine(row)
    generate = getattr(generator, "generate", None) or generator.module.generate
    ids = _prompt()

    def call() -> torch.Tensor:
        with torch.no_grad():
            return generate(input_ids=ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)

    seconds, tokens, cpu = _timed(call, rounds)
    return {"s": seconds, "cpu_s": cpu, "tok_s": BATCH * new_tokens / seconds, "tokens": tokens[:, PROMPT:].tolist()}


def _weights_row(rounds: int) -> dict[str, Any]:
    from slipstream.zero import GatheredParameters

    engine = _zero3_engine(True)
    module = engine.module

    def hand_off() -> int:
        return sum(value.numel() * value.element_size() for _, value in engine.iter_full_weights())

    def state_dict_gather() -> int:
        with GatheredParameters(list(module.parameters())):
            whole = {name: value.clone() for name, value in module.state_dict().items()}
        return sum(value.numel() * value.element_size() for value in whole.values())

    hand_s, hand_bytes, _ = _timed(hand_off, rounds)
    plain_s, plain_bytes, _ = _timed(state_dict_gather, rounds)
    return {
        "iter_gb_s": hand_bytes / hand_s / 1e9,
        "state_dict_gb_s": plain_bytes / plain_s / 1e9,
        "iter_mb": hand_bytes / 1e6,
        "state_dict_mb": plain_bytes / 1e6,
    }


def rank_main(rank: int, world: int, store_dir: str, row: str, new_tokens: int, rounds: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29998",
        SLIPSTREAM_LOG_LEVEL="warning",
    )
    if world > 1:
        dist.init_process_group(
            "gloo", store=dist.FileStore(os.path.join(store_dir, "store"), world), rank=rank, world_size=world
        )
    result = _weights_row(rounds) if row == "weights" else _generation_row(row, new_tokens, rounds)
    Path(store_dir, f"{rank}.json").write_text(json.dumps(result))
    if world > 1:
        dist.destroy_process_group()


def run_row(python: str, row: str, new_tokens: int, rounds: int) -> dict[str, Any] | str:
    """Rank 0's result of `row`, or why it failed (the last line of the first failing rank's stderr)."""
    world = 1 if row == "unsharded" else 2
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            subprocess.Popen(
                [python, __file__, "--rank", str(r), str(world), tmp, row, str(new_tokens), str(rounds)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for r in range(world)
        ]
        errors = [p.communicate()[1] for p in procs]
        for proc, err in zip(procs, errors):
            if proc.returncode:
                lines = [line for line in err.strip().splitlines() if line.strip()]
                return f"failed (exit {proc.returncode}): {lines[-1] if lines else '?'}"
        return json.loads(Path(tmp, "0.json").read_text())


def _report(results: dict[str, dict[str, Any]]) -> None:
    base = results.get("unsharded")
    print(f"  {'row':<18}{'s/call':>9}{'cpu s/call':>12}{'tokens/s':>10}{'x unsharded':>13}{'same tokens':>13}")
    for row, got in results.items():
        if row == "weights" or row.startswith("lora"):
            continue
        ratio = f"{got['tok_s'] / base['tok_s']:.2f}" if base else "-"
        same = ("yes" if got["tokens"] == base["tokens"] else "NO") if base else "-"
        print(f"  {row:<18}{got['s']:>9.3f}{got['cpu_s']:>12.3f}{got['tok_s']:>10.1f}{ratio:>13}{same:>13}")
    hybrid, naive = results.get("zero3_hybrid"), results.get("zero3_naive")
    split, tp_peer = results.get("zero3_hybrid_tp2"), results.get("ss_tp2")
    if split and hybrid:
        print(
            f"  hybrid tp 2 / hybrid tokens/s: {split['tok_s'] / hybrid['tok_s']:.2f}x (CPU {split['cpu_s'] / hybrid['cpu_s']:.2f}x)"
        )
    if split and tp_peer:
        print(f"  hybrid tp 2 / init_inference tp 2 tokens/s: {split['tok_s'] / tp_peer['tok_s']:.2f}x")
    if hybrid and naive:
        print(f"  hybrid / naive ZeRO-3 tokens/s: {hybrid['tok_s'] / naive['tok_s']:.2f}x (target >= 5x)")
    if hybrid and base:
        print(f"  unsharded / hybrid time: {hybrid['s'] / base['s']:.2f}x (target <= 1.3x)")
        print(f"  unsharded / hybrid CPU time of rank 0: {hybrid['cpu_s'] / base['cpu_s']:.2f}x")
    both = results.get("unsharded_x2")
    if hybrid and both:
        print(f"  unsharded on two ranks at once / hybrid time: {hybrid['s'] / both['s']:.2f}x")
    ours, theirs = results.get("ss_tp2"), results.get("ds_tp2")
    if ours and theirs:
        print(f"  init_inference tp 2, Slipstream / DeepSpeed tokens/s: {ours['tok_s'] / theirs['tok_s']:.2f}x")
    fused, unfused = results.get("lora_fused"), results.get("lora_unfused")
    if fused and unfused:
        same = "same tokens" if fused["tokens"] == unfused["tokens"] else "DIFFERENT tokens"
        print(
            f"  LoRA at ZeRO-1, hybrid (fused) {fused['tok_s']:.1f} vs plain (LoRA path per forward) "
            f"{unfused['tok_s']:.1f} tokens/s: {fused['tok_s'] / unfused['tok_s']:.2f}x, {same}"
        )
    weights = results.get("weights")
    if weights:
        print(
            f"  iter_full_weights {weights['iter_gb_s']:.3f} GB/s ({weights['iter_mb']:.1f} MB) vs state_dict "
            f"gather {weights['state_dict_gb_s']:.3f} GB/s ({weights['state_dict_mb']:.1f} MB): "
            f"{weights['iter_gb_s'] / weights['state_dict_gb_s']:.2f}x"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="1 round, 8 new tokens")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    parser.add_argument("--peer-python", default=str(ROOT / ".bench-venv/bin/python"))
    args = parser.parse_args()
    rounds, new_tokens = (1, 8) if args.quick else (args.rounds, args.new_tokens)
    print(
        f"generate: tiny Llama ({LAYERS} x {WIDTH}), batch {BATCH}, prompt {PROMPT}, {new_tokens} new tokens, "
        f"greedy, {rounds} rounds; 2 ranks (gloo, 1 thread each) unless unsharded"
    )
    results: dict[str, dict[str, Any]] = {}
    for row in args.rows.split(","):
        python = args.peer_python if row == "ds_tp2" else sys.executable
        if row == "ds_tp2" and not Path(python).exists():
            print(f"  {row}: skipped: no peer environment at {python} (bash bench/make_peer_venv.sh)")
            continue
        started = time.perf_counter()
        got = run_row(python, row, new_tokens, rounds)
        if isinstance(got, str):
            print(f"  {row}: skipped: {got}")
            continue
        results[row] = got
        print(f"  ({row}: {time.perf_counter() - started:.0f} s)", flush=True)
    _report(results)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        r, w, d, row, n, k = sys.argv[2:8]
        rank_main(int(r), int(w), d, row, int(n), int(k))
    else:
        main()

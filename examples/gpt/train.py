"""Train the small GPT of `model.py` on the shipped text with Slipstream and a DeepSpeed JSON config.

    python -m torch.distributed.run --nproc_per_node 2 examples/gpt/train.py \
        --deepspeed_config examples/gpt/ds_config_zero2.json
    python examples/gpt/train.py --deepspeed_config examples/gpt/ds_config_zero2.json   # one process

Owns the training loop of the main example: a DeepSpeed user's script with `import slipstream as
deepspeed` and nothing else changed. Rank 0 prints the loss every `--print_every` optimizer steps (the
engine adds its own line every `steps_per_print`), then the first and final loss, a short seeded sample
of generated text, and the path of the saved final model. The exit status is 1 when the final loss is
not clearly below the first (below `--max_final_ratio` times it), so the script doubles as a smoke test.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

# One intra-op thread per rank unless the user says otherwise, set before torch starts its thread pool:
# on a small, shared CPU machine oversubscribed OpenMP threads spin and run many times slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
sys.path.append(str(HERE.parents[1]))  # a source checkout works without `pip install -e .`

from data import CharDataset
from model import GPT, GPTConfig

import slipstream as deepspeed


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps to train")
    parser.add_argument(
        "--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", "0")), help="set by the launcher"
    )
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--print_every", type=int, default=25, help="optimizer steps between loss lines")
    parser.add_argument("--block_size", type=int, default=128, help="characters per training sample")
    parser.add_argument("--out_dir", type=Path, default=HERE / "out", help="where final_model.pt goes")
    parser.add_argument("--sample_chars", type=int, default=120, help="characters to generate at the end")
    parser.add_argument(
        "--max_final_ratio", type=float, default=0.9, help="fail unless final loss < this ratio x first loss"
    )
    deepspeed.add_config_arguments(parser)
    args = parser.parse_args(argv)
    if args.deepspeed_config is None:
        parser.error("--deepspeed_config is required, e.g. examples/gpt/ds_config_zero2.json")
    if args.steps <= 0:
        parser.error(f"--steps must be positive, got {args.steps}")
    return args


@torch.no_grad()
def sample(model: GPT, dataset: CharDataset, *, prompt: str, num_chars: int, seed: int) -> str:
    """A seeded continuation of `prompt` at temperature 0.8 (a visible sign of what the model learned)."""
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(seed)  # sampled on the CPU: the same text on any device
    device = next(model.parameters()).device
    ids = torch.tensor([[dataset.stoi[c] for c in prompt]], dtype=torch.long, device=device)
    for _ in range(num_chars):
        logits = model(ids[:, -model.config.block_size :])[:, -1] / 0.8
        next_id = torch.multinomial(torch.softmax(logits.float(), dim=-1).cpu(), 1, generator=generator)
        ids = torch.cat([ids, next_id.to(device)], dim=1)
    model.train(was_training)
    return dataset.decode(ids[0].tolist())


def train(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    dataset = CharDataset(block_size=args.block_size)
    model = GPT(GPTConfig(vocab_size=dataset.vocab_size, block_size=args.block_size))
    engine, _, dataloader, _ = deepspeed.initialize(args=args, model=model, training_data=dataset)
    rank = engine.global_rank

    def say(message: str) -> None:
        if rank == 0:
            print(message, flush=True)

    say(
        f"model: {model.num_parameters():,} parameters; data: {len(dataset.data):,} characters, "
        f"{len(dataset):,} samples of {args.block_size}; world size {engine.world_size}, "
        f"{torch.get_num_threads()} intra-op thread(s) per rank"
    )
    losses: list[float] = []
    started = time.perf_counter()
    epoch = 0
    while engine.global_steps < args.steps:
        dataloader.sampler.set_epoch(epoch)
        for inputs, targets in dataloader:
            before = engine.global_steps
            loss = engine(inputs.to(engine.device), targets.to(engine.device))
            engine.backward(loss)
            engine.step()
            if engine.global_steps == before:
                continue  # inside a gradient accumulation window
            losses.append(float(engine.last_loss))
            step = engine.global_steps
            if step == 1 or step % args.print_every == 0 or step == args.steps:
                say(
                    f"train.py: step {step:4d}/{args.steps}  loss {losses[-1]:.4f}  "
                    f"lr {engine.get_lr()[0]:.2e}  {time.perf_counter() - started:6.1f} s"
                )
            if step >= args.steps:
                break
        epoch += 1
    elapsed = time.perf_counter() - started
    tokens = args.steps * engine.train_batch_size() * args.block_size
    say(f"trained {args.steps} steps in {elapsed:.1f} s ({tokens / elapsed:,.0f} tokens/s over all ranks)")
    say(f"first loss {losses[0]:.4f}  final loss {losses[-1]:.4f}")
    # Every rank samples (the same seeded text) and takes part in the gather: at ZeRO-3 each forward gathers the
    # layers from all ranks, and the whole weights exist only inside GatheredParameters (a no-op below stage 3).
    text = sample(engine.module, dataset, prompt="In the morning, ", num_chars=args.sample_chars, seed=args.seed)
    say(f"sample: {text!r}")
    path = args.out_dir / "final_model.pt"
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        if rank == 0:
            args.out_dir.mkdir(parents=True, exist_ok=True)
            torch.save(engine.module.state_dict(), path)
    say(f"saved final model to {path}")
    if not losses[-1] < args.max_final_ratio * losses[0]:
        say(f"FAILED: final loss {losses[-1]:.4f} is not below {args.max_final_ratio} x first loss {losses[0]:.4f}")
        return 1
    say("OK: the loss fell")
    return 0


def main() -> int:
    args = parse_args()
    try:
        return train(args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())

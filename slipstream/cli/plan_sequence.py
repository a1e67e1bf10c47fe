"""`slipstream plan --sequence`: the command-line side of the long-context planner (planner/sequence.py).

Owns the long-context flags, the memory budget (`--memory`, else `--device-memory`, else the accelerator's
memory), the model states that share it (the config's row of the memory plan; without a config ZeRO-3 over
the ranks given, ZeRO-0 on one), and
the table or JSON printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("long context (--sequence: activations per option, the longest sequence)")
    group.add_argument(
        "--sequence",
        action="store_true",
        help="activation memory of each long-context option (checkpointing, offload, tiled MLP/loss, Ulysses) "
        "at --seq, and the longest sequence each trains at within --memory",
    )
    group.add_argument(
        "--memory",
        default=None,
        help="with --sequence: memory per rank, e.g. 80GB or 6GiB (default: --device-memory, else the "
        "accelerator's memory)",
    )
    group.add_argument(
        "--ulysses", type=int, default=1, help="with --sequence: Ulysses sequence-parallel degree (default 1)"
    )
    group.add_argument(
        "--intermediate", type=int, default=None, help="with --sequence: MLP width (default: read from the model)"
    )


def _budget(args: argparse.Namespace) -> int:
    from slipstream.checkpoint.export import parse_size

    text = args.memory or args.device_memory
    if text:
        return parse_size(text)
    from slipstream.accelerator import get_accelerator

    return int(get_accelerator().total_memory())


def run(args: argparse.Namespace, config: str | None) -> int:
    from slipstream.config import ConfigError
    from slipstream.planner import estimate
    from slipstream.planner.estimate import model_shape
    from slipstream.planner.sequence import format_sequence_rows, seq_dims, sequence_rows
    from slipstream.planner.shapes import Dims
    from slipstream.planner.types import DTYPE_BYTES, Option

    if args.ulysses < 1:
        print(f"slipstream plan --sequence: error: --ulysses must be >= 1, got {args.ulysses}", file=sys.stderr)
        return 2
    try:
        dims = Dims(hidden=args.hidden, layers=args.layers, heads=args.heads, vocab=args.vocab)
        shape = model_shape(params=args.params, model=args.model, hf_config=args.hf_config, dims=dims)
        machine = {f.name: getattr(shape.dims, f.name) for f in dataclasses.fields(Dims)}
        machine.update(gpus_per_node=args.gpus_per_node, nodes=args.nodes, dtype=args.dtype)
        single = [Option(stage=3 if args.gpus_per_node * args.nodes > 1 else 0)]  # without a config
        plan = estimate(model=shape.module, ds_config=config, options=None if config else single, **machine)
        states = plan.estimates[0]
        fixed = sum(states.device.values())
        budget = _budget(args)
        dtype_bytes = DTYPE_BYTES[plan.settings.dtype]
        found = seq_dims(shape, intermediate=args.intermediate)
        rows = sequence_rows(found, seq=args.seq, dtype_bytes=dtype_bytes, budget=budget, fixed_bytes=fixed)
        if args.ulysses > 1:
            rows += sequence_rows(
                found, seq=args.seq, dtype_bytes=dtype_bytes, ulysses=args.ulysses, budget=budget, fixed_bytes=fixed
            )
    except (ConfigError, ValueError, TypeError, OSError, ImportError, AttributeError) as exc:
        print(f"slipstream plan --sequence: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        import json

        print(
            json.dumps(
                {
                    "model_states_option": states.option.name,
                    "model_states": fixed,
                    "budget": budget,
                    "dims": dataclasses.asdict(found),
                    "rows": [dataclasses.asdict(row) for row in rows],
                },
                indent=2,
            )
        )
    else:
        print(f"model: {shape.source}; model states from the {states.option.name} row of the memory plan")
        print(format_sequence_rows(rows, seq=args.seq, budget=budget, fixed_bytes=fixed))
    return 0

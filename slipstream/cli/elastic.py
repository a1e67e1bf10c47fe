"""`slipstream elastic -c ds_config.json [-w WORLD]` (DeepSpeed's `ds_elastic`): the elastic batch size and the
GPU counts it allows, and for a world size the micro batch and accumulation steps that initialize() will use."""

from __future__ import annotations

import argparse
import json
import sys

HELP = "elastic training: the batch size and the valid GPU counts of a config's elasticity section"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-c", "--config", required=True, help="DeepSpeed config JSON with an elasticity section")
    parser.add_argument("-w", "--world-size", type=int, default=0, help="intended or current world size")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")


def run(args: argparse.Namespace) -> int:
    from slipstream.config import load_config
    from slipstream.config.elasticity import ElasticityError, compute_elastic_config

    try:
        config = load_config(args.config)
        figures = compute_elastic_config(config, "0.19.0", world_size=args.world_size)
    except (ElasticityError, OSError, ValueError) as error:
        print(f"slipstream elastic: error: {error}", file=sys.stderr)
        return 2
    section = config["elasticity"]
    result = {
        "train_batch_size": figures[0],
        "valid_world_sizes": figures[1],
        "min_time_minutes": section.get("min_time", 0),
        "version": section.get("version", 0.2),
    }
    if args.world_size > 0:
        data_parallel = args.world_size // int(section.get("model_parallel_size", 1))
        result.update(
            world_size=args.world_size,
            micro_batch_size=figures[2],
            gradient_accumulation_steps=figures[0] // (figures[2] * data_parallel),
        )
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"elastic batch size: {result['train_batch_size']}")
    print(f"valid world sizes ({len(figures[1])}): {', '.join(str(n) for n in figures[1])}")
    if args.world_size > 0:
        print(
            f"world size {args.world_size}: micro batch {result['micro_batch_size']} x accumulation "
            f"{result['gradient_accumulation_steps']} x data-parallel {args.world_size // int(section.get('model_parallel_size', 1))}"
        )
    return 0

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
    from slipstream.config.elasticity import ElasticityConfigError, ElasticityError, elastic_result, parse_section

    try:
        config = load_config(args.config)
        if not isinstance(config.get("elasticity"), dict) or config["elasticity"].get("enabled") is not True:
            raise ElasticityConfigError("elasticity.enabled: the config has no enabled elasticity section")
        section = parse_section(config["elasticity"])
        result = elastic_result(section, world_size=args.world_size)
    except (ElasticityError, OSError, ValueError) as error:
        print(f"slipstream elastic: error: {error}", file=sys.stderr)
        return 2
    figures: dict[str, object] = {
        "train_batch_size": result.train_batch_size,
        "valid_world_sizes": list(result.valid_world_sizes),
        "min_time_minutes": section.min_time,
        "version": section.version,
    }
    if result.micro_batch_size is not None:
        data_parallel = args.world_size // section.model_parallel_size
        accumulation = result.train_batch_size // (result.micro_batch_size * data_parallel)
        figures.update(
            world_size=args.world_size,
            micro_batch_size=result.micro_batch_size,
            gradient_accumulation_steps=accumulation,
        )
    if args.json:
        print(json.dumps(figures))
        return 0
    print(f"elastic batch size: {result.train_batch_size}")
    print(f"valid world sizes ({len(result.valid_world_sizes)}): {', '.join(map(str, result.valid_world_sizes))}")
    if result.micro_batch_size is not None:
        print(
            f"world size {args.world_size}: micro batch {result.micro_batch_size} x accumulation {accumulation} "
            f"x data-parallel {data_parallel}"
        )
    return 0

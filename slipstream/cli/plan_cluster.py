"""`slipstream plan --cluster`: the command-line side of the communication model (planner/comm_model.py).

Owns the cluster flags, reading the model size, dtypes, micro batch and ZeRO variant from the arguments and the
DeepSpeed config, and printing the detail (the config's variant, or ZeRO-3 without one) or the `--compare` table.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from slipstream.planner.comm_model import Variant


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("cluster (--cluster: communication and step time per ZeRO variant)")
    group.add_argument("--cluster", action="store_true", help="model communication and step time instead of memory")
    group.add_argument(
        "--compare", action="store_true", help="with --cluster: every ZeRO/ZeRO++/MiCS variant side by side"
    )
    group.add_argument(
        "--intra-bandwidth",
        "--intra_bandwidth",
        dest="intra_bandwidth",
        default=None,
        help="what one GPU sends inside its node, e.g. 900GB/s (bytes) or 7200Gb/s (bits)",
    )
    group.add_argument(
        "--inter-bandwidth",
        "--inter_bandwidth",
        dest="inter_bandwidth",
        default=None,
        help="what one node sends to the others (all its NICs), e.g. 400Gb/s or 50GB/s",
    )
    group.add_argument(
        "--flops", default=None, help="peak FLOP/s of one GPU in the training dtype, e.g. 990e12 or 990T"
    )
    group.add_argument("--mfu", type=float, default=0.5, help="share of --flops the compute reaches (default 0.5)")


def run(args: argparse.Namespace, config: str | None) -> int:
    from slipstream.config import ConfigError

    missing = [
        f"--{k.replace('_', '-')}" for k in ("intra_bandwidth", "inter_bandwidth", "flops") if not getattr(args, k)
    ]
    if missing or args.seq is None:
        print(
            f"slipstream plan --cluster: error: give {', '.join(missing + ['--seq'] * (args.seq is None))} "
            "(e.g. --intra-bandwidth 900GB/s --inter-bandwidth 400Gb/s --flops 990e12 --seq 4096)",
            file=sys.stderr,
        )
        return 2
    try:
        text = _plan_text(args, config)
    except (ConfigError, ValueError, TypeError, OSError, ImportError, AttributeError) as exc:
        print(f"slipstream plan --cluster: error: {exc}", file=sys.stderr)
        return 1
    print(text)
    return 0


def _plan_text(args: argparse.Namespace, config: str | None) -> str:
    from slipstream.planner.cluster import Cluster, parse_bandwidth, parse_flops
    from slipstream.planner.comm_model import Variant, compare_variants
    from slipstream.planner.comm_report import cluster_json, format_cluster_plan, model_steps

    cluster = Cluster(
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        intra_bandwidth=parse_bandwidth(args.intra_bandwidth, name="--intra-bandwidth"),
        inter_bandwidth=parse_bandwidth(args.inter_bandwidth, name="--inter-bandwidth"),
        flops=parse_flops(args.flops, name="--flops"),
        mfu=args.mfu,
    )
    numel = _numel(args)
    bytes_, micro, micro_steps, variant = _from_config(config, cluster.world, args.dtype)
    if args.compare:
        variants = compare_variants(cluster.gpus_per_node) + ([variant] if variant else [])
    else:
        variants = [variant or Variant(name="zero3", stage=3)]
    tokens = args.seq * (args.micro_batch or micro) * micro_steps
    models = model_steps(
        variants,
        numel=numel,
        tokens_per_gpu=tokens,
        micro_steps=micro_steps,
        cluster=cluster,
        param_bytes=bytes_,
        grad_bytes=bytes_,
    )
    if args.json:
        return cluster_json(models, cluster=cluster, numel=numel, tokens_per_gpu=tokens)
    return format_cluster_plan(models, cluster=cluster, numel=numel, tokens_per_gpu=tokens, compare=args.compare)


def _numel(args: argparse.Namespace) -> float:
    if args.params is not None:
        return float(args.params)
    if args.model is None and args.hf_config is None:
        raise ValueError("give the model: --params N, --model module:factory or --hf-config config.json")
    from slipstream.planner.estimate import model_shape
    from slipstream.planner.shapes import Dims

    dims = Dims(hidden=args.hidden, layers=args.layers, vocab=args.vocab, heads=args.heads)
    return float(model_shape(params=None, model=args.model, hf_config=args.hf_config, dims=dims).total)


def _from_config(config: str | None, world: int, dtype: str) -> tuple[int, int, int, Variant | None]:
    """(bytes per element on the wire, micro batch, micro steps, the config's Variant or None). Gradients travel
    in the parameter dtype, as DeepSpeed's default communication_data_type has them."""
    from slipstream.planner.comm_model import variant_from_config
    from slipstream.planner.types import DTYPE_BYTES

    if config is None:
        return DTYPE_BYTES[dtype], 1, 1, None
    from slipstream.config import load_config, resolve

    raw = load_config(config)
    plan = resolve(raw, world_size=world)
    zero = raw.get("zero_optimization", {}) or {}
    return (
        DTYPE_BYTES[plan.precision.param_dtype],
        plan.batch.micro_batch_size,
        plan.batch.gradient_accumulation_steps,
        variant_from_config(zero),
    )

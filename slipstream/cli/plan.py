"""`slipstream plan`: per-device and per-host memory of every ZeRO option; the logic is slipstream/planner/.

Owns the command line. torch is imported only when a model shape is built (on the meta device), so
`slipstream --help` stays fast.
"""

from __future__ import annotations

import argparse
import re
import sys

HELP = "memory each ZeRO option needs per device and per host (params, grads, optimizer, buffers, activations)"
_COUNT_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}


def parse_count(text: str) -> float:
    """Parameter counts: "7e9", "7B", "350M", "1.5T"."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)\s*([kKmMbBgGtT]?)\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a parameter count; write e.g. 7e9, 7B or 350M")
    return float(match.group(1)) * _COUNT_SUFFIX[match.group(2).upper()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _add_model_arguments(parser.add_argument_group("model (one of --params, --model, --hf-config)"))
    _add_run_arguments(parser.add_argument_group("run"))
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the plan as JSON instead of tables")
    out.add_argument("--png", default=None, metavar="FILE", help="also draw a stacked bar chart (needs matplotlib)")
    from slipstream.cli import plan_cluster, plan_sequence

    plan_cluster.add_arguments(parser)
    plan_sequence.add_arguments(parser)


def _add_model_arguments(model: argparse._ArgumentGroup) -> None:
    """What model: its size or where to read its shape from, and the dimensions of the activations."""
    model.add_argument("--params", type=parse_count, default=None, help="parameter count, e.g. 7e9 or 7B")
    model.add_argument(
        "--model",
        default=None,
        help="'package.module:factory' returning an nn.Module (built on the meta device: no memory used)",
    )
    model.add_argument(
        "--hf-config",
        "--hf_config",
        dest="hf_config",
        default=None,
        help="a Hugging Face config.json (parameter count and shapes from it)",
    )
    for name, text in (
        ("hidden", "hidden size (activations; shapes the synthetic model)"),
        ("layers", "transformer layers (activations; shapes the synthetic model)"),
        ("heads", "attention heads (activations)"),
        ("vocab", "vocabulary size (activations; embeddings of the synthetic model)"),
        ("seq", "sequence length (activations)"),
        ("micro-batch", "micro batch per GPU (activations; default: the config's, else 1)"),
    ):
        flags = dict.fromkeys([f"--{name}", f"--{name.replace('-', '_')}"])
        model.add_argument(*flags, dest=name.replace("-", "_"), type=int, default=None, help=text)
    model.add_argument(
        "--fused-attention",
        action="store_true",
        help="flash/memory-efficient attention: no seq x seq scores in the activation estimate",
    )


def _add_run_arguments(run: argparse._ArgumentGroup) -> None:
    """The DeepSpeed config, the machine and the question asked (the plan or --largest)."""
    run.add_argument(
        "config",
        nargs="?",
        default=None,
        help="a DeepSpeed JSON config to evaluate (its own row first, its knobs for every row)",
    )
    run.add_argument(
        "--deepspeed_config",
        "--deepspeed-config",
        "--config",
        dest="config_option",
        default=None,
        help="same as the positional CONFIG",
    )
    run.add_argument("--gpus-per-node", "--gpus_per_node", "--num_gpus", dest="gpus_per_node", type=int, default=1)
    run.add_argument("--nodes", "--num_nodes", dest="nodes", type=int, default=1)
    run.add_argument(
        "--dtype",
        choices=("fp32", "bf16", "fp16"),
        default="bf16",
        help="parameter dtype without a config (default bf16)",
    )
    run.add_argument(
        "--device-memory",
        "--device_memory",
        dest="device_memory",
        default=None,
        help="memory of one accelerator, e.g. 80GB (powers of 10) or 80GiB",
    )
    run.add_argument(
        "--host-memory", "--host_memory", dest="host_memory", default=None, help="memory of one host, e.g. 512GB"
    )
    run.add_argument(
        "--nvme-free",
        "--nvme_free",
        dest="nvme_free",
        default=None,
        help="free space on one host's NVMe offload disk, e.g. 3.5TB, or a directory to read it from",
    )
    run.add_argument(
        "--largest",
        action="store_true",
        help="the inverse question: the largest model of this --hidden (and --heads, --vocab, --seq) that fits "
        "the memory and disk given, per option",
    )


def run(args: argparse.Namespace) -> int:
    from slipstream.config import ConfigError
    from slipstream.planner import draw_png, estimate, format_plan, plan_json

    config = args.config or args.config_option
    if args.cluster:
        from slipstream.cli import plan_cluster

        return plan_cluster.run(args, config)
    if args.largest:
        return _run_largest(args, config)
    if args.sequence:
        from slipstream.cli import plan_sequence

        return plan_sequence.run(args, config)
    if args.params is None and args.model is None and args.hf_config is None and not (args.hidden and args.layers):
        print(
            "slipstream plan: error: give the model: --params N, --model module:factory or --hf-config "
            "config.json (or --hidden and --layers)",
            file=sys.stderr,
        )
        return 2
    try:
        plan = estimate(
            params=args.params,
            model=args.model,
            hf_config=args.hf_config,
            layers=args.layers,
            ds_config=config,
            **_machine_and_shape(args),
        )
    except (ConfigError, ValueError, TypeError, OSError, ImportError, AttributeError) as exc:
        print(f"slipstream plan: error: {exc}", file=sys.stderr)
        return 1
    print(plan_json(plan) if args.json else format_plan(plan))
    if args.png:
        skipped = draw_png(plan, args.png)
        print(
            f"slipstream plan: {skipped}" if skipped else f"chart written to {args.png}",
            file=sys.stderr if skipped else sys.stdout,
        )
    return 0


def _machine_and_shape(args: argparse.Namespace) -> dict:
    """The keyword arguments `estimate` and `largest` share: the model's width and the machine."""
    from slipstream.checkpoint.export import parse_size

    return {
        "hidden": args.hidden,
        "heads": args.heads,
        "vocab": args.vocab,
        "seq": args.seq,
        "micro_batch": args.micro_batch,
        "gpus_per_node": args.gpus_per_node,
        "nodes": args.nodes,
        "dtype": args.dtype,
        "fused_attention": args.fused_attention,
        "device_memory": parse_size(args.device_memory) if args.device_memory else None,
        "host_memory": parse_size(args.host_memory) if args.host_memory else None,
    }


def _run_largest(args: argparse.Namespace, config: str | None) -> int:
    import os
    import shutil

    from slipstream.checkpoint.export import parse_size
    from slipstream.config import ConfigError
    from slipstream.planner.largest import format_largest, largest

    if args.hidden is None:
        print(
            "slipstream plan --largest: error: give the model's width: --hidden (and --heads, --vocab, --seq)",
            file=sys.stderr,
        )
        return 2
    nvme_free = None
    if args.nvme_free:
        nvme_free = shutil.disk_usage(args.nvme_free).free if os.path.isdir(args.nvme_free) else None
    try:
        if args.nvme_free and nvme_free is None:
            nvme_free = parse_size(args.nvme_free)
        answers = largest(ds_config=config, nvme_free=nvme_free, **_machine_and_shape(args))
    except (ConfigError, ValueError, TypeError, OSError) as exc:
        print(f"slipstream plan: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        import json

        rows = [{"option": a.option, "layers": a.layers, "params": a.params, "bound": a.bound} for a in answers]
        print(json.dumps({"hidden": args.hidden, "largest": rows}, indent=2))
    else:
        print(format_largest(answers, hidden=args.hidden))
    return 0

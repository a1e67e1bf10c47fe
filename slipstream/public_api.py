"""The public API, listed in one place (docs/support.md: what semantic versioning covers).

`PUBLIC_API` names, per module, what users may import. `snapshot()` renders each name's kind and signature
(for a class: its constructor and every public method), and `tests/unit/test_public_api.py` compares that
with the committed `tests/unit/data/public_api.json`, so a removal or a signature change fails CI until it is
deliberate: `python -m slipstream.public_api --write` updates the snapshot, and CHANGELOG.md says why.
DeepSpeed's spellings that map onto these (the `deepspeed.*` paths of compat/aliases.py) follow them.
"""

from __future__ import annotations

import enum
import importlib
import inspect
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["PUBLIC_API", "snapshot"]

PUBLIC_API: dict[str, tuple[str, ...]] = {
    "slipstream": (
        "initialize",
        "init_distributed",
        "add_config_arguments",
        "get_accelerator",
        "SlipstreamEngine",
        "DeepSpeedEngine",
        "ConfigError",
        "__version__",
        "init_inference",
    ),
    "slipstream.inference": ("init_inference", "InferenceEngine", "DeepSpeedInferenceConfig"),
    "slipstream.fp8": ("Float8Linear", "convert_to_float8_training", "fp8_hardware"),
    "slipstream.zero": (
        "Init",
        "GatheredParameters",
        "unwrap_model_for_generation",
        "register_external_parameter",
        "ZeroParamStatus",
        "ShardedParameterError",
        "set_z3_leaf_modules",
        "broadcast_full_weights",
        "receive_full_weights",
    ),
    "slipstream.accelerator": ("get_accelerator", "set_accelerator", "is_current_accelerator_supported"),
    "slipstream.comm": (
        "init_distributed",
        "is_initialized",
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "broadcast",
        "barrier",
        "CollectiveError",
        "CollectiveTimeout",
        "PeerLost",
    ),
    "slipstream.ops.adam": (
        "DeepSpeedCPUAdam",
        "FusedAdam",
        "ZenFlowCPUAdam",
        "ZenFlowSelectiveAdamW",
        "ZenFlowSelectiveAdamW_stage3",
    ),
    "slipstream.pipe": (
        "PipelineModule",
        "LayerSpec",
        "TiedLayerSpec",
        "PipelineEngine",
        "PipelineError",
        "ProcessTopology",
        "PipeDataParallelTopology",
        "PipelineParallelGrid",
    ),
    "slipstream.checkpoint": ("export_checkpoint", "CheckpointError", "CheckpointCorrupt"),
    "slipstream.config": ("ConfigError", "ConfigWarning"),
    "slipstream.utils.deprecation": ("SlipstreamDeprecationWarning",),
    "slipstream.utils.torch_versions": ("TorchTooOld",),
}


def _signature(obj: Any) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"  # a builtin without a signature


def _describe(obj: object) -> Any:
    if inspect.isclass(obj):
        if issubclass(obj, BaseException):
            return {"kind": "exception", "bases": [base.__name__ for base in obj.__mro__[1:-1]]}
        if issubclass(obj, enum.Enum):  # members, not the constructor (whose signature varies by Python)
            return {"kind": "enum", "members": [member.name for member in obj]}
        methods: dict[str, str] = {}
        for klass in obj.__mro__:  # the class and Slipstream's own bases (not nn.Module's methods)
            if klass is obj or klass.__module__.startswith("slipstream"):
                for name, member in vars(klass).items():
                    if name.startswith("_") or name in methods:
                        continue
                    if isinstance(member, property):
                        methods[name] = "property"
                    elif callable(member) or isinstance(member, (staticmethod, classmethod)):
                        methods[name] = _signature(getattr(obj, name))
        return {"kind": "class", "init": _signature(obj.__init__), "methods": dict(sorted(methods.items()))}
    if callable(obj):
        return {"kind": "function", "signature": _signature(obj)}
    return {"kind": type(obj).__name__}


def snapshot() -> dict[str, dict[str, Any]]:
    """Module -> name -> kind and signature(s), for every name of `PUBLIC_API`."""
    result: dict[str, dict[str, Any]] = {}
    for module_name, names in PUBLIC_API.items():
        module = importlib.import_module(module_name)
        result[module_name] = {name: _describe(getattr(module, name)) for name in names}
    return result


SNAPSHOT_PATH = Path(__file__).resolve().parents[1] / "tests" / "unit" / "data" / "public_api.json"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    text = json.dumps(snapshot(), indent=1, sort_keys=True) + "\n"
    if args == ["--write"]:
        SNAPSHOT_PATH.parent.mkdir(parents=True, exist_ok=True)
        SNAPSHOT_PATH.write_text(text)
        print(f"wrote {SNAPSHOT_PATH}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

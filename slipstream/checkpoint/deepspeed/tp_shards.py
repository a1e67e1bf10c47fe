"""Each tensor-parallel rank's whole shards of a DeepSpeed-format checkpoint, and writing them merged as universal
tensor files.

Owns `TpShards` (what the folder readers zero3_grid.py and zero12_grid.py return), `write_tp_shards` and
`check_conversion_support`. A universal file is `{"param": whole tensor, "cat_dim" | "sub_param_shape" | ...}`
(tp_merge.py's merge of the ranks' shards), or, for a ZeRO-3 folder without tensor parallelism, DeepSpeed's
bare flat tensor; a parameter's `step.pt` is written where the folder records a step per parameter (ZeRO-1/2).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from slipstream.checkpoint.deepspeed.constants import AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS
from slipstream.checkpoint.deepspeed.safe_pickle import DeepSpeedStub
from slipstream.checkpoint.deepspeed.tp_merge import MergeRules, merge_slices
from slipstream.checkpoint.errors import CheckpointError, ConversionMetadataError

__all__ = ["TpShards", "check_conversion_support", "plain", "write_tp_shards"]


@dataclass
class TpShards:
    """`shards[tp][name][state]`: tensor rank tp's whole shard of `name` (shaped as that rank's files record it)
    for state "fp32" and the optimizer moments."""

    shards: list[dict[str, dict[str, torch.Tensor]]]
    names: list[str]
    """Every parameter, in the order the first files list them."""
    universal_info: dict[str, Any] | None
    """The folder's `universal_checkpoint_info` (None: not recorded)."""
    optimizer_state: dict[str, Any]
    """What `zero/optimizer_state.pt` holds: the unpartitioned optimizer entries, param groups at the top level."""
    model_files: list[Path]
    """The folder's model-states files, copied into the output unchanged."""
    steps: dict[str, Any] = field(default_factory=dict)
    """Parameter name -> its optimizer step, where the folder keeps one per parameter group (ZeRO-1/2)."""

    @property
    def tp_degree(self) -> int:
        return len(self.shards)


def check_conversion_support(info: Mapping[str, Any] | None) -> None:
    """Refuse a checkpoint whose writer declared parameters it cannot describe (fused layouts it cut its own way)."""
    unsupported = (info or {}).get(AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS) or {}
    if unsupported:
        details = ", ".join(f"{pattern}: {reason}" for pattern, reason in sorted(unsupported.items()))
        raise ValueError(
            f"this AutoTP checkpoint cannot be converted to a universal checkpoint; its writer declared these "
            f"parameters' layouts unsupported: {details}. Load it at its own tensor-parallel size instead"
        )


_DROP = object()


def plain(value: object) -> Any:
    """`value` as plain data, so the file loads without DeepSpeed's classes: a DeepSpeed enum as its value, any
    other DeepSpeed object (the loss scaler) left out, so a loading engine keeps its own."""
    if isinstance(value, DeepSpeedStub):
        return value.value if value.args else _DROP
    if isinstance(value, Mapping):
        items = ((k, plain(v)) for k, v in value.items())
        return {k: v for k, v in items if v is not _DROP}
    if isinstance(value, (list, tuple)):
        return type(value)(v for v in map(plain, value) if v is not _DROP)
    return value


def write_tp_shards(shards: TpShards, zero_dir: Path, *, flat_without_tp: bool, strict: bool, where: Path) -> None:
    """Write `zero/<name>/<state>.pt` (and `step.pt`) for every parameter, then `zero/optimizer_state.pt`.

    `flat_without_tp`: at tensor-parallel size 1 write bare flat tensors (DeepSpeed's ZeRO-3 form) instead of
    merged dicts. `strict`: a merge pattern of `universal_checkpoint_info` that matched no parameter is an error."""
    rules = MergeRules.from_info(shards.universal_info)
    if shards.tp_degree > 1:
        check_conversion_support(shards.universal_info)
    merged = shards.tp_degree > 1 or not flat_without_tp
    for name in shards.names:
        folder = zero_dir / name
        folder.mkdir(parents=True, exist_ok=True)
        holders = [tp for tp, shard in enumerate(shards.shards) if name in shard]
        if len(holders) != shards.tp_degree:
            missing = sorted(set(range(shards.tp_degree)) - set(holders))
            raise CheckpointError(
                f"{where}: tensor ranks {missing} hold no shard of {name}; the checkpoint is incomplete or mixes "
                "two saves"
            )
        if name in shards.steps:
            torch.save(shards.steps[name], folder / "step.pt")
        for state in shards.shards[0][name]:
            if any(state not in shard[name] for shard in shards.shards):
                raise CheckpointError(f"{where}: not every tensor rank holds the {state} of {name}")
            pieces = [shard[name][state] for shard in shards.shards]
            if merged:
                torch.save(merge_slices(name, pieces, rules), folder / f"{state}.pt")
            else:
                torch.save(pieces[0].reshape(-1).clone(), folder / f"{state}.pt")
    unused = sorted(rules.unused()) if merged else []
    if unused and strict:
        raise ConversionMetadataError(
            f"{where}: patterns {unused} of universal_checkpoint_info matched no parameter ({shards.names}); the "
            "metadata belongs to another model. Pass --no_strict to convert anyway"
        )
    if unused:
        print(f"ds_to_universal: warning: patterns {unused} matched no parameter")
    zero_dir.mkdir(parents=True, exist_ok=True)
    torch.save(plain(shards.optimizer_state), zero_dir / "optimizer_state.pt")

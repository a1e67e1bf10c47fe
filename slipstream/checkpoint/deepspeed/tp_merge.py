"""One parameter's tensor-parallel slices of a DeepSpeed-format checkpoint -> the whole tensor of a universal
checkpoint, following the checkpoint's `universal_checkpoint_info` (the merge rules its writer recorded).

Owns `MergeRules` (the patterns of that info) and `merge_slices`. The rules, by the first that matches the
parameter's name (`re.match`):

- replicated: every rank holds the same tensor; one copy is kept (the copies must be equal).
- to average: the mean of the slices.
- two sub-parameters along dim 0: each half of every slice is gathered separately, then the halves.
- sub-parameters (`parameter_with_sub_params`): a fused parameter; see subparam.py. Metadata of version 0.4
  records each rank's width of each sub-parameter (`sub_param_shard_widths`, required at that version);
  older metadata gives the sub-parameter widths (or their count) and implies an even split.
- otherwise concatenation along dim 1 for row-parallel patterns, dim 0 for the rest (`cat_dim` is recorded).

A vocabulary pattern then drops the padded rows beyond `original_vocab_size`. The returned dict is what the
universal tensor file holds (`param`, and `cat_dim` / `sub_param_shape` / `param_n_sub_params` /
`vocab_tensor` where they apply).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from slipstream.checkpoint.deepspeed.constants import (
    CAT_DIM,
    ORIGINAL_VOCAB_SIZE,
    PARAM,
    PARAM_N_SUB_PARAMS,
    PARAMETER_TO_AVERAGE_PATTERNS,
    PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0,
    PARAMETER_WITH_ROW_PARALLELISM_PATTERNS,
    PARAMETER_WITH_SUB_PARAMS,
    SUB_PARAM_SHAPE,
    SUB_PARAM_SHARD_WIDTHS,
    TP_REPLICATED_PARAMETER_PATTERNS,
    UNIVERSAL_CHECKPOINT_VERSION_KEY,
    VOCAB_TENSOR,
    VOCABULARY_PARAMETER_PATTERNS,
)
from slipstream.checkpoint.deepspeed.subparam import (
    SubparamShape,
    check_widths,
    even_widths,
    merge_rank_slices,
    resolve_placeholder,
)
from slipstream.checkpoint.errors import ConversionMetadataError

__all__ = ["MergeRules", "merge_slices"]

WIDTHS_VERSION = 0.4
"""From this metadata version on, a sub-parameter pattern must come with its per-rank widths."""


@dataclass
class MergeRules:
    """The merge patterns of one checkpoint's `universal_checkpoint_info`, and which of them have matched."""

    replicated: list[str]
    average: list[str]
    row_parallel: list[str]
    vocabulary: list[str]
    two_sub_params: list[str]
    sub_params: list[SubparamShape]
    shard_widths: dict[str, Any]
    version: float
    original_vocab_size: int | None
    used: set[str] = field(default_factory=set)

    @classmethod
    def from_info(cls, info: Mapping[str, Any] | None) -> MergeRules:
        info = info or {}
        return cls(
            replicated=list(info.get(TP_REPLICATED_PARAMETER_PATTERNS, [])),
            average=list(info.get(PARAMETER_TO_AVERAGE_PATTERNS, [])),
            row_parallel=list(info.get(PARAMETER_WITH_ROW_PARALLELISM_PATTERNS, [])),
            vocabulary=list(info.get(VOCABULARY_PARAMETER_PATTERNS, [])),
            two_sub_params=list(info.get(PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0, [])),
            sub_params=[SubparamShape(**entry) for entry in info.get(PARAMETER_WITH_SUB_PARAMS, [])],
            shard_widths=dict(info.get(SUB_PARAM_SHARD_WIDTHS, {})),
            version=float(info.get(UNIVERSAL_CHECKPOINT_VERSION_KEY, 0.0)),
            original_vocab_size=info.get(ORIGINAL_VOCAB_SIZE),
        )

    def patterns(self) -> set[str]:
        lists = (self.replicated, self.average, self.row_parallel, self.vocabulary, self.two_sub_params)
        return {p for patterns in lists for p in patterns} | {p for s in self.sub_params for p in s.patterns}

    def unused(self) -> set[str]:
        return self.patterns() - self.used

    def match(self, patterns: Sequence[str], name: str) -> str | None:
        found = [pattern for pattern in patterns if re.match(pattern, name)]
        if len(found) > 1:
            raise ConversionMetadataError(
                f"parameter {name!r} matches several patterns of one merge rule: {found}; make them exclusive"
            )
        if found:
            self.used.add(found[0])
            return found[0]
        return None

    def match_sub_params(self, name: str) -> tuple[SubparamShape, str] | tuple[None, None]:
        for shape in self.sub_params:
            for pattern in shape.patterns:
                if re.match(pattern, name):
                    self.used.add(pattern)
                    return shape, pattern
        return None, None


def merge_slices(name: str, slices: Sequence[torch.Tensor], rules: MergeRules) -> dict[str, Any]:
    """The universal tensor file's dict for one state (fp32, exp_avg, ...) of parameter `name`, from its
    tensor-parallel ranks' `slices` (each shaped as that rank's shard)."""
    out: dict[str, Any] = {}
    sub_shape, sub_pattern = rules.match_sub_params(name)
    if rules.match(rules.replicated, name):
        first = slices[0]
        differing = [rank for rank, other in enumerate(slices[1:], 1) if not first.equal(other)]
        if differing:
            raise ConversionMetadataError(
                f"{name} is declared tensor-parallel replicated, but ranks {differing} hold values different from "
                "rank 0's; the checkpoint's tp_replicated_parameter_patterns do not describe it"
            )
        param = first
    elif rules.match(rules.average, name):
        param = sum(slices[1:], slices[0].clone()) / len(slices)
    elif rules.match(rules.two_sub_params, name):
        halves = [piece.chunk(2, dim=0) for piece in slices]
        param = torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
        out[CAT_DIM] = 0
        out[PARAM_N_SUB_PARAMS] = 2
    elif sub_shape is not None:
        param, out[SUB_PARAM_SHAPE] = _merge_sub_params(name, slices, sub_shape, str(sub_pattern), rules)
    else:
        dim = 1 if rules.match(rules.row_parallel, name) else 0
        param = torch.cat(list(slices), dim=dim)
        out[CAT_DIM] = dim
    if rules.match(rules.vocabulary, name):
        if rules.original_vocab_size is None:
            raise ConversionMetadataError(
                f"{name} matches a vocabulary pattern, but universal_checkpoint_info records no "
                f"{ORIGINAL_VOCAB_SIZE} to strip the padding to"
            )
        param = param[: int(rules.original_vocab_size)]
        out[VOCAB_TENSOR] = True
    out[PARAM] = param
    return out


def _merge_sub_params(
    name: str, slices: Sequence[torch.Tensor], sub: SubparamShape, pattern: str, rules: MergeRules
) -> tuple[torch.Tensor, SubparamShape]:
    dim = sub.partition_dim
    spec = sub.shape[dim]
    tp = len(slices)
    normalized = sub
    if rules.version >= WIDTHS_VERSION:
        sizes = tuple(spec) if isinstance(spec, (tuple, list)) else (spec,)
        if pattern not in rules.shard_widths:
            raise ConversionMetadataError(
                f"universal checkpoint version {rules.version} records no {SUB_PARAM_SHARD_WIDTHS} for {name}, whose "
                f"pattern {pattern!r} declares sub-parameters; the metadata is inconsistent (an even split is not "
                "assumed at this version). Re-save the checkpoint"
            )
        widths = [list(row) for row in rules.shard_widths[pattern]]
    else:
        if isinstance(spec, (tuple, list)):
            sizes = tuple(spec)
        else:  # before 0.4 a scalar here is the number of equal sub-parameters
            if any(piece.dim() <= dim for piece in slices):
                raise ConversionMetadataError(
                    f"{name}: legacy sub-parameter metadata (a count, {spec}) needs the ranks' slice shapes, but the "
                    "slices are flat"
                )
            total = sum(piece.shape[dim] for piece in slices)
            if spec <= 0 or total % spec:
                raise ConversionMetadataError(
                    f"{name}: {spec} equal sub-parameters do not divide the {total} rows of dim {dim}"
                )
            sizes = (total // spec,) * spec
            shape = list(sub.shape)
            shape[dim] = sizes
            normalized = SubparamShape(patterns=list(sub.patterns), shape=tuple(shape), partition_dim=dim)
        widths = even_widths(sizes, tp, name)
    check_widths(widths, sizes, tp, name)
    logical = [sum(d) if isinstance(d, (tuple, list)) else d for d in sub.shape]
    logical[dim] = sum(sizes)
    logical = resolve_placeholder(logical, sum(piece.numel() for piece in slices), name)
    return merge_rank_slices(slices, logical, dim, widths, name), normalized

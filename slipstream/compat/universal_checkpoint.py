"""DeepSpeed's `deepspeed.checkpoint.universal_checkpoint`: restoring one rank's part of a universal tensor into a
parameter that carries DeepSpeed's fragment mapping.

Owns `load_hp_checkpoint_state` (bound to a parameter as a method by `enable_universal_checkpoint`),
`_resolve_autotp_partition` and `_get_param_uc_restore_meta`; `SubparamShape` is checkpoint/deepspeed/subparam.py's.

The parameter interface is DeepSpeed's: `param._hp_mapping` has `lp_fragment_address` (`start`, `numel`: the
part of the rank's flattened slice this parameter's fp32 fragment holds), `get_hp_fragment()` (the fp32
fragment to copy into) and `optim_fragment` (filled with the optimizer states read); an AutoTP parameter also
carries `ds_autotp_universal_checkpoint_meta` (partition dim, logical shape, sub-parameter sizes and per-rank
widths, explicit uneven partition sizes, or replicated). Slipstream's own engine loads universal checkpoints
through checkpoint/deepspeed/universal.py instead (global tensors sliced by its own sharding), so nothing here is on
that path. Files are read with the restricted unpickler.
"""

from __future__ import annotations

import os
import types
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from slipstream.checkpoint.deepspeed.constants import (
    CAT_DIM,
    DS_AUTOTP_UC_META,
    EP_IS_EXPERT_PARAM,
    EP_NUM_EXPERTS,
    FP32_WEIGHT_KEY,
    PARAM,
    PARAM_N_SUB_PARAMS,
    SUB_PARAM_SHAPE,
    UNIVERSAL_CHECKPOINT_VERSION_KEY,
    VOCAB_TENSOR,
)
from slipstream.checkpoint.deepspeed.safe_pickle import DeepSpeedStub, safe_load
from slipstream.checkpoint.deepspeed.subparam import SubparamShape, check_widths, even_widths, rank_slice
from slipstream.checkpoint.deepspeed.tp_merge import WIDTHS_VERSION
from slipstream.checkpoint.errors import ConversionMetadataError

__all__ = [
    "SubparamShape",
    "_get_param_uc_restore_meta",
    "_resolve_autotp_partition",
    "enable_universal_checkpoint",
    "load_hp_checkpoint_state",
]


def _get_param_uc_restore_meta(param: Any) -> Mapping[str, Any] | None:
    """The AutoTP restore metadata of `param` (its top-level fields; conversion-time fields sit under
    "conversion"), or None for a parameter AutoTP did not touch."""
    return getattr(param, DS_AUTOTP_UC_META, None)


def _sub_sizes(meta: Mapping[str, Any], dim: int) -> tuple[tuple[int, ...] | None, int]:
    """The resolved sub-parameter widths (and the partition dim they are along), preferring `sub_param_sizes`:
    a `sub_param_shape` entry may be a count (legacy (3, -1) views), not widths."""
    sizes = meta.get("sub_param_sizes")
    if sizes is None and meta.get("sub_param_shape") is not None:
        shape = meta["sub_param_shape"]
        if isinstance(shape, SubparamShape) or (hasattr(shape, "shape") and hasattr(shape, "partition_dim")):
            dim = shape.partition_dim
            shape = shape.shape
        sizes = shape[dim]
    if sizes is None:
        return None, dim
    return (tuple(sizes) if isinstance(sizes, (tuple, list)) else (int(sizes),)), dim


def _resolve_autotp_partition(
    current_param: Any, ckpt_dict: Mapping[str, Any], full_hp_param: torch.Tensor, tp_rank: int, tp_world_size: int
) -> torch.Tensor | None:
    """Rank `tp_rank`'s flattened slice of the universal tensor `full_hp_param` as the parameter's AutoTP
    metadata describes it, or None when there is no such metadata (the generic rules apply)."""
    meta = _get_param_uc_restore_meta(current_param)
    if not meta:
        return None
    reason = (meta.get("conversion") or {}).get("unsupported_reason")
    if reason:
        raise RuntimeError(f"cannot restore a universal checkpoint into this AutoTP parameter: {reason}")
    dim = meta.get("partition_dim")
    if meta.get("replicated", False):
        if dim is not None:
            raise ConversionMetadataError(f"AutoTP metadata marks a parameter replicated with partition_dim={dim}")
        return full_hp_param.flatten()
    logical = meta.get("logical_shape")
    if dim is None or logical is None:
        return None
    full = full_hp_param.view(tuple(logical))
    sizes, dim = _sub_sizes(meta, dim)
    if sizes is not None:
        version = float(meta.get(UNIVERSAL_CHECKPOINT_VERSION_KEY, 0.0))
        what = f"parameter of shape {tuple(logical)}"
        if sum(sizes) != full.shape[dim]:
            raise ConversionMetadataError(
                f"{what}: sub-parameter sizes {list(sizes)} sum to {sum(sizes)}, not dim {dim}'s {full.shape[dim]}"
            )
        widths = meta.get("sub_param_shard_widths") if version >= WIDTHS_VERSION else None
        if widths is None:
            widths = even_widths(sizes, tp_world_size, what)
        check_widths(widths, sizes, tp_world_size, what)
        return rank_slice(full, dim, sizes, widths, tp_rank).flatten()
    explicit = meta.get("partition_sizes")
    if explicit is not None:
        return full.narrow(dim, sum(explicit[:tp_rank]), explicit[tp_rank]).flatten()
    if full.shape[dim] % tp_world_size:
        raise ConversionMetadataError(
            f"dim {dim} of size {full.shape[dim]} is not divisible by the tensor-parallel size {tp_world_size} and "
            "the metadata records no partition_sizes, so the uneven split cannot be reconstructed"
        )
    return full.chunk(tp_world_size, dim=dim)[tp_rank].flatten()


def _generic_slice(
    ckpt: Mapping[str, Any], full: torch.Tensor, tp_rank: int, tp_size: int, local_numel: int, file: str
) -> torch.Tensor:
    """The rank's slice by the universal file's own record (sub-parameter shape, sub-parameter count, cat dim)."""
    if full.numel() != tp_size * local_numel:
        raise ConversionMetadataError(
            f"{file}: the universal tensor has {full.numel()} elements, not {tp_size} ranks x {local_numel}; it "
            "belongs to another parameter or tensor-parallel layout"
        )
    sub = ckpt.get(SUB_PARAM_SHAPE)
    if isinstance(sub, DeepSpeedStub):  # a file DeepSpeed's converter wrote: its SubparamShape, read inert
        sub = SubparamShape(**sub.state)
    dim = int(ckpt.get(CAT_DIM, 0))
    count = int(ckpt.get(PARAM_N_SUB_PARAMS, 1))
    if sub:
        sizes = sub.shape[sub.partition_dim]
        sizes = tuple(sizes) if isinstance(sizes, (tuple, list)) else (sizes,)
        view = full.view([sum(d) if isinstance(d, (tuple, list)) else d for d in sub.shape])
        return rank_slice(view, sub.partition_dim, sizes, even_widths(sizes, tp_size, file), tp_rank).flatten()
    if count > 1:
        parts = [part.chunk(tp_size, dim=dim)[tp_rank] for part in full.chunk(count, dim=dim)]
        return torch.cat(parts, dim=dim).flatten()
    return full.chunk(tp_size, dim=dim)[tp_rank].flatten()


def load_hp_checkpoint_state(
    self: Any, folder: str, tp_rank: int, tp_world_size: int, ep_rank: int = 0, ep_size: int = 1
) -> Any:
    """Load the universal folder of one parameter (`fp32.pt`, the moments, `step.pt`) into this parameter's
    fp32 fragment and `optim_fragment`; returns the step (None without step.pt)."""
    mapping = self._hp_mapping
    mapping.optim_fragment = {}
    keys = sorted(name[: -len(".pt")] for name in os.listdir(folder) if name.endswith(".pt"))
    step = None
    has_meta = _get_param_uc_restore_meta(self) is not None
    for key in keys:
        file = os.path.join(folder, f"{key}.pt")
        ckpt = safe_load(file)
        if key == "step":
            step = ckpt
            continue
        if not isinstance(ckpt, Mapping):
            ckpt = {PARAM: ckpt}
        full = ckpt[PARAM]
        expert = bool(ckpt.get(EP_IS_EXPERT_PARAM, False))
        if expert and ep_size > 1:
            full = _expert_rows(full, ckpt.get(EP_NUM_EXPERTS), ep_rank, ep_size, file)
        rank, size = tp_rank, tp_world_size
        if full.shape == self.shape and not has_meta:  # averaged or replicated: every rank holds it whole
            rank, size = 0, 1
        if ckpt.get(VOCAB_TENSOR, False) and not expert and not has_meta:
            padded = self.shape[0] * size
            if padded < full.shape[0]:
                raise ConversionMetadataError(
                    f"{file}: {full.shape[0]} vocabulary rows do not fit {size} ranks x {self.shape[0]} rows"
                )
            full = torch.nn.functional.pad(full, (0, 0, 0, padded - full.shape[0]))
        piece = _resolve_autotp_partition(self, ckpt, full, rank, size)
        if piece is None:
            piece = _generic_slice(ckpt, full, rank, size, self.numel(), file)
        address = mapping.lp_fragment_address
        fragment = piece.narrow(0, address.start, address.numel)
        if key == FP32_WEIGHT_KEY:
            target = mapping.get_hp_fragment()
            if target.numel() != address.numel:
                raise ConversionMetadataError(
                    f"{file}: the parameter's fp32 fragment has {target.numel()} elements, its address says "
                    f"{address.numel}"
                )
            target.data.copy_(fragment.data)
        else:
            mapping.optim_fragment[key] = fragment.clone().detach()
    return step


def _expert_rows(full: torch.Tensor, num_experts: Any, ep_rank: int, ep_size: int, file: str) -> torch.Tensor:
    if num_experts is None or full.shape[0] != num_experts or num_experts % ep_size:
        raise ConversionMetadataError(
            f"{file}: an expert parameter needs {EP_NUM_EXPERTS} equal to its first dim ({full.shape[0]}) and "
            f"divisible by the expert-parallel size {ep_size}; found {num_experts!r}"
        )
    local = num_experts // ep_size
    return full[ep_rank * local : (ep_rank + 1) * local]


def enable_universal_checkpoint(param_list: Iterable[Any]) -> None:
    """Give each parameter a `load_hp_checkpoint_state` method (DeepSpeed's optimizers call it on load)."""
    for param in param_list:
        param.load_hp_checkpoint_state = types.MethodType(load_hp_checkpoint_state, param)

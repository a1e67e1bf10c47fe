"""Ulysses attention for Hugging Face Transformers models (DeepSpeed's `UlyssesSPAttentionHF`), on
`DistributedAttention`.

A Transformers attention layer computes q, k, v for its tokens ([batch, heads, seq, head_dim]) and hands them
to a function of its attention interface (`ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`), which
returns [batch, seq, heads, head_dim]. `install` replaces that entry by `UlyssesSPAttentionHF`, which swaps
the rank's slice of the sequence (all heads) for the whole sequence (its share of the heads), calls the
original function there and swaps the result back; everything else the model does (rotary embeddings,
projections, the MLP, the loss) runs on the rank's slice. Replacing the entry itself, not registering a new
name, keeps the model's own branches for that implementation (`if config._attn_implementation == "sdpa"`).

What the wrapped function sees:
- the attention mask is dropped (None), so the function masks causally over the whole sequence (`sdpa` and the
  flash kernels do with no mask). A model's 4-D mask was built for the local slice and would be wrong after
  the swap (and O(seq^2)); padding inside a sequence is therefore not masked: pack or trim batches instead.
  `eager` needs a mask and is refused, `flex_attention`'s BlockMask too (not rebuilt here).
- `position_ids`, when the model passes them, are all-gathered to the whole sequence's (the flash kernels
  read packed-sequence boundaries from them). The model itself must get the global positions of its slice
  (`UlyssesSPDataLoaderAdapter` and `shard_sequence` put them in the batch), or rotary/learned position
  embeddings restart at 0 on every rank.
- k and v with fewer heads than the group size (multi-query, few KV groups) are repeated to the group size
  first (the group size must be a multiple of their head count); `module.num_key_value_groups` is set to the
  ratio of the local heads for the call and restored after.

Slices of unequal length are exact ([Note: uneven sequence lengths] in layer.py). `head_chunks` is
DistributedAttention's (one chunk of the local heads at a time, recomputed in backward).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from slipstream.comm import collectives
from slipstream.sequence.layer import DistributedAttention, sequence_lengths
from slipstream.utils.logging import warn_once

__all__ = ["UNSUPPORTED_CORE_ATTENTION", "UlyssesSPAttentionHF", "gather_sequence", "install"]

UNSUPPORTED_CORE_ATTENTION = {
    "eager": "it needs a 4-D attention mask of the whole sequence (O(seq^2) memory), which Ulysses drops",
    "paged|eager": "it needs a 4-D attention mask of the whole sequence (O(seq^2) memory), which Ulysses drops",
    "flex_attention": "its BlockMask is built for the local slice and is not rebuilt for the whole sequence here",
}
"""Core attention implementations `install` refuses, with why."""


def gather_sequence(t: torch.Tensor, group: dist.ProcessGroup | None, dim: int = 1) -> torch.Tensor:
    """Every rank's `t` concatenated along `dim` in rank order (slices may differ in length there). No
    gradient: for integer tensors like position ids."""
    size = dist.get_world_size(group)
    if size == 1:
        return t
    counts = sequence_lengths(t.shape[dim], group, t.device)
    longest = max(counts)
    mine = t.movedim(dim, 0)
    padded = mine.new_zeros((longest, *mine.shape[1:]))
    padded[: mine.shape[0]] = mine
    gathered = padded.new_empty((size * longest, *mine.shape[1:]))
    collectives.all_gather(gathered, padded.contiguous(), group=group)
    pieces = [gathered[r * longest : r * longest + n] for r, n in enumerate(counts)]
    return torch.cat(pieces).movedim(0, dim)


@contextmanager
def _kv_groups(module: Any, groups: int) -> Iterator[None]:
    """`module.num_key_value_groups` set to `groups` for one call (what the core function repeats k, v by)."""
    held = getattr(module, "num_key_value_groups", None)
    if held is None or held == groups:
        yield
        return
    module.num_key_value_groups = groups
    try:
        yield
    finally:
        module.num_key_value_groups = held


class UlyssesSPAttentionHF(nn.Module):
    """A Transformers attention function (`attn(module, q, k, v, attention_mask, *args, **kwargs) -> (out,
    weights)`) run Ulysses-parallel over `process_group`. The sizes DeepSpeed's constructor takes are checked
    against the group (head counts it must divide); shapes are read from each call's tensors, so
    `seq_length_is_variable` and the sequence lengths are accepted for DeepSpeed's signature only.
    `disable_in_eval=True` calls `attn` unchanged on modules in eval mode (each rank then passes whole
    sequences). `head_chunks` (Slipstream's own): see DistributedAttention."""

    def __init__(
        self,
        attn: Callable[..., Any],
        batch_size: int,
        attn_head_count: int,
        attn_head_size: int,
        kv_head_count: int,
        num_hidden_layers: int,
        process_group: dist.ProcessGroup | None,
        seq_length_is_variable: bool = False,
        local_seq_length: int | None = None,
        global_seq_length: int | None = None,
        disable_in_eval: bool = False,
        *,
        head_chunks: int | None = None,
    ) -> None:
        super().__init__()
        del seq_length_is_variable, local_seq_length, global_seq_length  # shapes come from each call
        self.attn = attn
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.sp_rank = dist.get_rank(process_group)
        self.batch_size, self.num_hidden_layers = batch_size, num_hidden_layers
        self.attn_head_count, self.attn_head_size, self.global_kv_head_count = (
            attn_head_count,
            attn_head_size,
            kv_head_count,
        )
        self.disable_in_eval = disable_in_eval
        self.core_attn_implementation: str | None = None
        size = self.world_size
        if attn_head_count % size:
            raise ValueError(
                f"UlyssesSPAttentionHF: the model has {attn_head_count} attention heads, which the sequence-parallel "
                f"size {size} does not divide; use a sequence_parallel_size that divides it"
            )
        if kv_head_count % size and size % kv_head_count:
            raise ValueError(
                f"UlyssesSPAttentionHF: the model has {kv_head_count} key/value heads and the sequence-parallel size "
                f"is {size}; one must divide the other (KV heads are split, or repeated up to the group size)"
            )
        self.kv_replication_factor = size // kv_head_count if size > kv_head_count else 1
        self.ulysses = DistributedAttention(
            self._core, process_group, scatter_idx=1, gather_idx=2, head_chunks=head_chunks
        )

    def _core(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        module: torch.nn.Module,
        args: tuple[object, ...],
        kwargs: dict[str, object],
    ) -> torch.Tensor:
        """The wrapped function on the whole sequence and this rank's heads; [batch, heads, seq, dim] back."""
        with _kv_groups(module, query.shape[1] // key.shape[1]):
            out = self.attn(module, query, key, value, None, *args, **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        return out.transpose(1, 2)

    def forward(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        if self.disable_in_eval and not getattr(module, "training", True):
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)  # type: ignore[no-any-return]
        if isinstance(attention_mask, torch.Tensor):
            warn_once(
                "ulysses-hf-mask",
                "slipstream: Ulysses sequence parallelism drops the attention mask the model built for its slice "
                "and attends causally over the whole sequence (as DeepSpeed's UlyssesSPAttentionHF does): padding "
                "inside a batch is not masked. Pack sequences (with position_ids) or trim padding from batches.",
            )
        if self.kv_replication_factor > 1 and key.shape[1] < self.world_size:
            key = key.repeat_interleave(self.world_size // key.shape[1], dim=1)
            value = value.repeat_interleave(self.world_size // value.shape[1], dim=1)
        positions = kwargs.get("position_ids")
        if isinstance(positions, torch.Tensor) and positions.dim() >= 2:
            kwargs["position_ids"] = gather_sequence(positions, self.process_group, dim=1)
        out = self.ulysses(query, key, value, module, args, kwargs)
        return out.transpose(1, 2), None


def install(
    core_attn_implementation: str, wrap: Callable[[Callable[..., Any]], UlyssesSPAttentionHF]
) -> UlyssesSPAttentionHF:
    """Replace `ALL_ATTENTION_FUNCTIONS[core_attn_implementation]` by `wrap(core)`, Ulysses around that core
    attention function (every model of this process that uses that implementation then runs sequence-parallel).
    Returns the wrapper."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if core_attn_implementation in UNSUPPORTED_CORE_ATTENTION:
        raise ValueError(
            f"Ulysses sequence parallelism cannot wrap attn_implementation {core_attn_implementation!r}: "
            f"{UNSUPPORTED_CORE_ATTENTION[core_attn_implementation]}; use 'sdpa' or a flash attention implementation"
        )
    _load_hub_kernel(core_attn_implementation)
    if core_attn_implementation not in ALL_ATTENTION_FUNCTIONS:
        raise ValueError(
            f"{core_attn_implementation!r} is not an attention implementation Transformers knows; the choices are "
            f"{sorted(ALL_ATTENTION_FUNCTIONS.valid_keys())}"
        )
    core = ALL_ATTENTION_FUNCTIONS[core_attn_implementation]
    previous = getattr(core, "__self__", None)
    if isinstance(previous, UlyssesSPAttentionHF):  # registered before: wrap the original, not the wrapper
        core = previous.attn
    wrapper = wrap(core)
    wrapper.core_attn_implementation = core_attn_implementation
    ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = wrapper.__call__
    return wrapper


def _load_hub_kernel(name: str) -> None:
    """Hub kernels ("org/repo[@rev][:fn]") register lazily in Transformers; register one before it is checked."""
    import re

    if not re.fullmatch(r"[^/:]+/[^/:]+(?:@[^/:]+)?(?::[^/:]+)?", name):
        return
    try:
        from transformers.modeling_flash_attention_utils import lazy_import_flash_attention
    except ImportError as exc:
        raise ImportError(
            f"attn_implementation {name!r} is a hub kernel, and this Transformers version has no "
            "`lazy_import_flash_attention` to load it; upgrade transformers or use 'sdpa'"
        ) from exc
    lazy_import_flash_attention(name)

"""DeepSpeed's `deepspeed.moe.mappings`: `gather_tokens` / `drop_tokens`, which gather a tensor's pieces from
the tensor-parallel ranks (or keep only this rank's piece) around an MoE layer.

Slipstream runs MoE without tensor parallelism (the engine refuses the combination), so the tensor-parallel
group has one rank and both return the input unchanged, as DeepSpeed's do at that size. With a TP layout
built they raise NotBuiltError instead of returning a wrong shape.
"""

from __future__ import annotations

import torch

from slipstream.compat.unbuilt import NotBuiltError

__all__ = ["drop_tokens", "gather_tokens"]


def _check_single_rank(name: str) -> None:
    from slipstream.compat.groups import get_tensor_model_parallel_world_size

    size = get_tensor_model_parallel_world_size()
    if size > 1:
        raise NotBuiltError(
            f"moe.mappings.{name} over a tensor-parallel group (size {size})",
            "MoE layers run with tensor_parallel.autotp_size 1",
        )


def gather_tokens(input_: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """The tensor-parallel ranks' pieces of `input_` concatenated along `dim` (one rank: `input_`)."""
    _check_single_rank("gather_tokens")
    return input_


def drop_tokens(input_: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """This tensor-parallel rank's piece of `input_` along `dim` (one rank: `input_`)."""
    _check_single_rank("drop_tokens")
    return input_

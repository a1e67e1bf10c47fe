"""DeepSpeed's `deepspeed.module_inject.tp_shard` sizing helpers: how many rows of a dimension each
tensor-parallel rank holds under AutoTP's rules.

Owns `get_shard_size`, `get_shard_size_list` and the key/value-head count they split by (`set_num_kv_heads`).
The rules: when the number of key/value heads is known and divides the dimension (and the layer is not an MLP
or the output head), whole heads are dealt out, the first `heads % ranks` ranks getting one more; otherwise the
rows are dealt out alike (near-even). Slipstream's own tensor parallelism (parallel/tensor.py) shards through
DTensor and does not consult these; they serve code that reads or writes AutoTP-layout checkpoints.
"""

from __future__ import annotations

__all__ = ["get_num_kv_heads", "get_shard_size", "get_shard_size_list", "set_num_kv_heads"]

num_kv_heads: int | None = None
_LAST_LINEAR = ("lm_head", "embed_out")
_MLP_NAMES = ("mlp", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


def set_num_kv_heads(num: int | None) -> None:
    global num_kv_heads
    num_kv_heads = num


def get_num_kv_heads() -> int | None:
    return num_kv_heads


def get_shard_size(
    total_size: int, mp_size: int, name: str | None = None, rank: int = 0, num_kv_heads: int | None = None
) -> int:
    """Rows of a `total_size` dimension that tensor-parallel rank `rank` (0 <= rank < mp_size) holds."""
    if not 0 <= rank < mp_size:
        raise ValueError(f"rank {rank} is outside the tensor-parallel group of size {mp_size}")
    heads = get_num_kv_heads() if num_kv_heads is None else num_kv_heads
    text = str(name)
    if (
        heads is not None
        and total_size % heads == 0
        and not any(s in text for s in _MLP_NAMES)
        and text not in _LAST_LINEAR
    ):
        mine = heads // mp_size + (1 if rank < heads % mp_size else 0)
        return total_size * mine // heads
    return total_size // mp_size + (1 if rank < total_size % mp_size else 0)


def get_shard_size_list(
    total_size: int, mp_size: int, name: str | None = None, num_kv_heads: int | None = None
) -> list[int]:
    """Every rank's rows of a `total_size` dimension; they sum to `total_size`."""
    sizes = [get_shard_size(total_size, mp_size, name, rank, num_kv_heads) for rank in range(mp_size)]
    if sum(sizes) != total_size:
        raise ValueError(
            f"shard sizes {sizes} of {name!r} do not sum to {total_size} (tp={mp_size}, kv heads={num_kv_heads})"
        )
    return sizes

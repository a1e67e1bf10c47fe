"""BufferPool's lent memory ([Note: lent gathered memory] in zero/stage3/pool.py), without a process group.

A view taken of a unit's buffer while it is lent memory (as autograd saves views of the parameters in the
forward) sees what the next lend of the same storage holds; the memory lent is the same each time, so it is
allocated once; `forget` and `drop_idle` let it go.
"""

from __future__ import annotations

import pytest
import torch

from slipstream.utils.torch_shim import CAN_SWAP_STORAGE_MEMORY
from slipstream.zero.stage3.pool import BufferPool


def _emptied(numel: int, *, view: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    full = torch.empty(numel)
    kept = full[10:20].view(2, 5) if view else None  # made while gathered, as autograd saves the parameters
    full.untyped_storage().resize_(0)
    return full, kept


@pytest.mark.skipif(not CAN_SWAP_STORAGE_MEMORY, reason="this torch cannot swap storages' memory")
def test_lent_memory_is_reused_and_views_see_it() -> None:
    pool = BufferPool(torch.device("cpu"))
    full, view = _emptied(1000, view=True)
    assert view is not None
    buffer = pool.lend(full)
    assert buffer is not None and full.untyped_storage().nbytes() == 4000
    address = full.data_ptr()
    full.copy_(torch.arange(1000.0))
    assert torch.equal(view.reshape(-1), torch.arange(10.0, 20.0))
    pool.reclaim(full, buffer)
    assert full.untyped_storage().nbytes() == 0 and pool.gathered_bytes == 4000
    other, _ = _emptied(1000)  # another unit of the same size gets the same memory
    lent = pool.lend(other)
    assert lent is not None and other.data_ptr() == address and pool.gathered_bytes == 4000
    second = pool.lend(full)  # both gathered at once: a second buffer
    assert second is not None and full.data_ptr() != address and pool.gathered_bytes == 8000
    full.fill_(7.0)
    assert torch.equal(view, torch.full((2, 5), 7.0))
    pool.reclaim(other, lent)
    pool.forget(second)  # the memory stays with `full`'s storage (aliases kept it)
    assert pool.gathered_bytes == 4000 and full.untyped_storage().nbytes() == 4000
    pool.drop_idle()
    assert pool.gathered_bytes == 0 and pool.free_buffers() == []

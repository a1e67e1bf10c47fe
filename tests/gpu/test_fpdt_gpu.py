"""FPDT's host offload from a CUDA device: chunked attention with its chunks in pinned host memory equals SDPA,
the host buffers are pinned, and the device memory one forward + backward allocates beyond its inputs is a
fraction of what it allocates with the chunks kept on the device (torch.cuda's allocator, not counted bytes).

Marked `gpu` (skipped without a CUDA device): `pytest -m gpu tests/gpu/test_fpdt_gpu.py`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slipstream.accelerator import get_accelerator
from slipstream.sequence.fpdt_attention import fpdt_attention
from slipstream.sequence.fpdt_store import DeviceChunks, HostChunks

pytestmark = pytest.mark.gpu


def _inputs(seq: int, dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    device = get_accelerator().current_device_name()
    return [torch.randn(1, seq, 8, 64, generator=gen).to(device=device, dtype=dtype) for _ in range(4)]


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
def test_offloaded_chunks_equal_sdpa_on_cuda(dtype: torch.dtype, tol: float) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    *qkv, upstream = _inputs(1000, dtype)
    store = HostChunks()
    got = [t.clone().requires_grad_() for t in qkv]
    (fpdt_attention(*got, chunk_size=256, store=store) * upstream).sum().backward()
    ref = [t.float().clone().requires_grad_() for t in qkv]
    out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in ref), is_causal=True).transpose(1, 2)
    (out * upstream.float()).sum().backward()
    for g, r in zip(got, ref):
        torch.testing.assert_close(g.grad.float(), r.grad, rtol=tol, atol=tol)
    assert store.stats.offloaded > 0 and store.stats.fetched_on_demand > 0
    pool = store._free  # the host buffers, all free again once the backward is done
    assert pool and all(get_accelerator().is_pinned(b) for b in pool)


def _step_peak(store: DeviceChunks | HostChunks, inputs: list[torch.Tensor]) -> int:
    *qkv, upstream = inputs
    leaves = [t.clone().requires_grad_() for t in qkv]
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    (fpdt_attention(*leaves, chunk_size=512, store=store) * upstream).sum().backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def test_offload_frees_device_memory() -> None:
    inputs = _inputs(16384, torch.float32)
    kept = _step_peak(DeviceChunks(), inputs)
    host = HostChunks()
    _step_peak(host, inputs)  # the first step allocates the host pool
    offloaded = _step_peak(host, inputs)
    # both hold the output, its product with the upstream gradient and the three input gradients (5 sequence-long
    # tensors) and one chunk pair's scores; kept also holds q, k, v, the output, its gradient and dq (6 more)
    assert offloaded < 0.6 * kept, (offloaded, kept)

"""The 1-bit error-compensated all-reduce (1-bit Adam, https://arxiv.org/abs/2102.02888), on any backend.

[Note: 1-bit compression]
A tensor of n elements is padded to a multiple of 8 * world and seen as `world` chunks (rows), one per rank;
rank j is the "server" of chunk j. Compressing a row x keeps its signs (x >= 0 is +1, else -1; 0 counts as
+1, as in DeepSpeed) and one scale, ||x|| / sqrt(len(x)); the row's compression error is x - scale * sign(x).
One call runs in phases:
    Phase 1 (worker): x = tensor + worker_error; compress every row; worker_error = x - its compressed value.
    Phase 2: one all-to-all of the packed rows (8 signs per byte, the row's scale appended as 4 raw bytes):
             server j receives every rank's row j.
    Phase 3 (server): y = mean over ranks of the decompressed rows + server_error; compress y;
             server_error = y - its compressed value.
    Phase 4: one all-gather of the servers' packed rows; every rank decompresses the whole tensor.
Every rank ends with the same values. The errors carry what compression dropped into the next call, so over
many calls the sum of what was sent follows the sum of the true means. The padded staging buffer, both error
buffers and both packed buffers are allocated once, at construction, and reused by every call.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from slipstream.comm import collectives

__all__ = ["OneBitAllReduce", "compress_rows", "pack_signs", "unpack_signs"]

_SCALE_BYTES = 4  # one float32 scale per packed row
# [Note: packing signs with one multiply] Eight sign bytes (0 or 1) read as one little-endian int64 v: the
# product v * _GATHER has, in its top byte, byte 0 in bit 7 down to byte 7 in bit 0 (no carries reach it, since
# every byte is 0 or 1). Unpacking copies the byte into all eight (p * _SPREAD) and keeps bit 7 - k in byte k.
_GATHER = 0x8040201008040201 - 2**64  # as a signed int64
_SPREAD = 0x0101010101010101
_BIT_OF_BYTE = 0x0102040810204080


def _pack_bits(nonneg: torch.Tensor) -> torch.Tensor:
    """[r, n] bool (n a multiple of 8) -> [r, n / 8] uint8, the first of each 8 in the high bit."""
    eights = nonneg.view(torch.uint8).view(torch.int64)  # see [Note: packing signs with one multiply]
    return eights.mul(_GATHER).bitwise_right_shift_(56).bitwise_and_(0xFF).to(torch.uint8)


def _unpack_bits(packed: torch.Tensor) -> torch.Tensor:
    """[r, m] uint8 -> [r, 8 m] bool (the inverse of `_pack_bits`)."""
    spread = packed.to(torch.int64).mul_(_SPREAD).bitwise_and_(_BIT_OF_BYTE)
    return spread.view(torch.uint8).ne(0)


def pack_signs(rows: torch.Tensor) -> torch.Tensor:
    """[r, n] values (n a multiple of 8) -> [r, n / 8] uint8: bit set where the value is >= 0."""
    return _pack_bits((rows >= 0).contiguous())


def unpack_signs(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[r, m] uint8 -> [r, 8 m] of +1 / -1 in `dtype` (the inverse of `pack_signs` on signs)."""
    return _unpack_bits(packed).to(dtype).mul_(2).sub_(1)


def compress_rows(rows: torch.Tensor, error: torch.Tensor, packed: torch.Tensor) -> None:
    """Compress every row of `rows` into `packed` ([r, n / 8 + 4] uint8: signs, then the float32 scale's bytes)
    and write the compression error into `error` (same shape as `rows`). See [Note: 1-bit compression]."""
    num_rows, numel = rows.shape
    scales = torch.linalg.vector_norm(rows, dim=1, keepdim=True).div_(math.sqrt(numel))
    nonneg = rows >= 0
    torch.sub(rows, _signed(nonneg, scales, rows.dtype), out=error)  # rows - scale * sign
    packed[:, : numel // 8] = _pack_bits(nonneg)
    packed[:, numel // 8 :] = scales.to(torch.float32).view(torch.uint8).view(num_rows, _SCALE_BYTES)


def decompress_rows(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[r, m + 4] packed rows -> [r, 8 m] values scale * sign, in `dtype`."""
    scales = packed[:, -_SCALE_BYTES:].contiguous().view(torch.float32).to(dtype)  # [r, 1]
    return _signed(_unpack_bits(packed[:, :-_SCALE_BYTES]), scales, dtype)


def _signed(nonneg: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """scale where `nonneg`, else -scale, per row: 2 s b - s is exact (and faster than torch.where here)."""
    return nonneg.to(dtype).mul_(scales * 2).sub_(scales)


class OneBitAllReduce:
    """The mean of one tensor's values over `group`, through 1-bit compression with error feedback; one object
    per tensor, holding that tensor's worker and server errors (see [Note: 1-bit compression])."""

    def __init__(
        self, numel: int, *, dtype: torch.dtype, device: torch.device, group: dist.ProcessGroup | None = None
    ) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.numel = numel
        quantum = 8 * self.world_size
        self.padded_numel = -(-numel // quantum) * quantum
        self.chunk_numel = self.padded_numel // self.world_size
        row_bytes = self.chunk_numel // 8 + _SCALE_BYTES
        self._staging = torch.zeros(self.padded_numel, dtype=dtype, device=device)
        self.worker_error = torch.zeros(self.padded_numel, dtype=dtype, device=device)
        """This rank's compression error of its whole (padded) tensor, carried into the next call."""
        self.server_error = torch.zeros(self.chunk_numel, dtype=dtype, device=device)
        """The compression error of the chunk this rank serves, carried into the next call."""
        self._sent = torch.empty(self.world_size, row_bytes, dtype=torch.uint8, device=device)
        self._received = torch.empty_like(self._sent)
        self._served = torch.empty(1, row_bytes, dtype=torch.uint8, device=device)
        self._gathered = torch.empty_like(self._sent)

    def wire_bytes(self) -> int:
        """Bytes this rank hands to the collectives per call (the all-to-all's input, the all-gather's output)."""
        return 2 * self._sent.numel()

    def reset_errors(self) -> None:
        self.worker_error.zero_()
        self.server_error.zero_()

    @torch.no_grad()
    def __call__(self, tensor: torch.Tensor) -> None:
        """Replace `tensor` (contiguous, `numel` elements) by the compressed mean over the group, in place."""
        if tensor.numel() != self.numel:
            raise ValueError(
                f"OneBitAllReduce was built for {self.numel} elements but got a tensor of {tensor.numel()}; "
                "build one OneBitAllReduce per tensor"
            )
        if self.world_size == 1:
            return
        flat = tensor.view(-1)
        rows, work_rows = self._staging.view(self.world_size, -1), self.worker_error.view(self.world_size, -1)
        # Phase 1: add the worker error, compress every row (the error buffer is the result's output)
        self._staging[: self.numel].copy_(flat)
        self._staging[self.numel :].zero_()  # the padding: the last call's values are still there
        self._staging.add_(self.worker_error)
        compress_rows(rows, work_rows, self._sent)
        # Phase 2: row j of every rank to rank j
        collectives.all_to_all(self._received, self._sent, group=self.group)
        # Phase 3: average what this rank serves, add the server error, compress again
        served = decompress_rows(self._received, self._staging.dtype).mean(dim=0, keepdim=True)
        served.add_(self.server_error)
        compress_rows(served, self.server_error.view(1, -1), self._served)
        # Phase 4: every server's row to every rank
        collectives.all_gather(self._gathered.view(-1), self._served.view(-1), group=self.group)
        flat.copy_(decompress_rows(self._gathered, self._staging.dtype).view(-1)[: self.numel])

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
many calls the sum of what was sent follows the sum of the true means. Both error buffers and the packed
buffers are allocated once, at construction, and reused by every call; the work buffers (Scratch) can be shared
by every all-reduce of a dtype and device.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from slipstream.comm import collectives

__all__ = [
    "OneBitAllReduce",
    "Scratch",
    "compress_rows",
    "decompress_rows",
    "pack_signs",
    "padded_numel",
    "unpack_signs",
]

_SCALE_BYTES = 4  # one float32 scale per packed row
# [Note: packing signs with one multiply] Eight sign bytes (0 or 1) read as one little-endian int64 v: the
# product v * _GATHER has, in its top byte, byte 0 in bit 7 down to byte 7 in bit 0 (no carries reach it, since
# every byte is 0 or 1). Unpacking goes through a table instead: see [Note: signs by table].
_GATHER = 0x8040201008040201 - 2**64  # as a signed int64


def _sign_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 8]: the eight signs (+1 / -1, first in the high bit) that each packed byte stands for."""
    codes = torch.arange(256, dtype=torch.int32, device=device).view(256, 1)
    shifts = torch.arange(7, -1, -1, dtype=torch.int32, device=device)
    return torch.bitwise_right_shift(codes, shifts).bitwise_and_(1).to(dtype).mul_(2).sub_(1)


@dataclasses.dataclass(frozen=True, slots=True)
class Scratch:
    """Work buffers of the compressed all-reduces, allocated once (a fresh 200 MB temporary per call costs more in
    page faults than the arithmetic); views of them serve both the worker's rows and the server's one row, and one
    Scratch serves every all-reduce of its dtype and device that fits it (their calls never overlap)."""

    staging: torch.Tensor
    """The padded tensor plus its worker error, the rows the worker compresses (padded numel)."""

    values: torch.Tensor
    """Decompressed values, scale * sign, in the tensor's dtype (padded numel)."""
    bits: torch.Tensor
    """Sign bits as bool (padded numel)."""
    words: torch.Tensor
    """int64 words, 8 signs each (padded numel / 8)."""
    codes: torch.Tensor
    """The packed bytes as int32 indices into `signs` (padded numel / 8)."""
    signs: torch.Tensor
    """[256, 8] +1 / -1 per packed byte (`_sign_table`); `table` is it times one row's scale."""
    table: torch.Tensor

    @staticmethod
    def allocate(numel: int, dtype: torch.dtype, device: torch.device) -> Scratch:
        return Scratch(
            staging=torch.empty(numel, dtype=dtype, device=device),
            values=torch.empty(numel, dtype=dtype, device=device),
            bits=torch.empty(numel, dtype=torch.bool, device=device),
            words=torch.empty(numel // 8, dtype=torch.int64, device=device),
            codes=torch.empty(numel // 8, dtype=torch.int32, device=device),
            signs=_sign_table(dtype, device),
            table=torch.empty(256, 8, dtype=dtype, device=device),
        )

    def nbytes(self) -> int:
        """Bytes of every buffer here (planner/zero_bytes.py `compressed_allreduce_bytes` predicts them)."""
        return _nbytes(*(getattr(self, f.name) for f in dataclasses.fields(self)))

    def shaped(self, rows: int, numel: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(values, bits, words) viewed as `rows` rows of `numel` elements."""
        count = rows * numel
        return (
            self.values[:count].view(rows, numel),
            self.bits[:count].view(rows, numel),
            self.words[: count // 8].view(rows, numel // 8),
        )

    def expand(self, packed: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` [r, 8 m] = scale * sign from `packed` [r, m] sign bytes and `scales` [r, 1]; see [Note: signs
        by table]."""
        num_rows, num_bytes = packed.shape
        codes = self.codes[: num_rows * num_bytes].view(num_rows, num_bytes)
        codes.copy_(packed)
        for row in range(num_rows):
            torch.mul(self.signs, scales[row], out=self.table)
            torch.index_select(self.table, 0, codes[row], out=out[row].view(num_bytes, 8))
        return out


# [Note: signs by table] A packed byte stands for 8 signs; scale * sign for a whole row is one gather of 8-value
# rows from a 256-row table (the signs times the row's scale: +scale or -scale, exact), indexed by the bytes. That
# reads n / 8 bytes and writes n values once, where unpacking to bools and converting them to floats walks the
# row four times (the bool -> float conversion alone costs more than the gather).


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def padded_numel(numel: int, world_size: int) -> int:
    """`numel` rounded up to a multiple of 8 * `world_size`: whole bytes of signs in every rank's chunk."""
    quantum = 8 * world_size
    return -(-numel // quantum) * quantum


def _pack_bits(bits: torch.Tensor, words: torch.Tensor, out: torch.Tensor) -> None:
    """[r, n] bool (n a multiple of 8) -> `out` [r, n / 8] uint8, the first of each 8 in the high bit."""
    torch.mul(bits.view(torch.uint8).view(torch.int64), _GATHER, out=words)  # [Note: packing signs with ...]
    words.bitwise_right_shift_(56).bitwise_and_(0xFF)
    out.copy_(words)


def pack_signs(rows: torch.Tensor) -> torch.Tensor:
    """[r, n] values (n a multiple of 8) -> [r, n / 8] uint8: bit set where the value is >= 0."""
    out = torch.empty(rows.shape[0], rows.shape[1] // 8, dtype=torch.uint8, device=rows.device)
    _pack_bits((rows >= 0).contiguous(), torch.empty(out.shape, dtype=torch.int64, device=rows.device), out)
    return out


def unpack_signs(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[r, m] uint8 -> [r, 8 m] of +1 / -1 in `dtype` (the inverse of `pack_signs` on signs)."""
    signs = _sign_table(dtype, packed.device)
    return signs[packed.long()].view(packed.shape[0], packed.shape[1] * 8)


def compress_rows(rows: torch.Tensor, error: torch.Tensor, packed: torch.Tensor, scratch: Scratch) -> None:
    """Compress every row of `rows` into `packed` ([r, n / 8 + 4] uint8: signs, then the float32 scale's bytes)
    and write the compression error into `error` (same shape as `rows`). See [Note: 1-bit compression]."""
    num_rows, numel = rows.shape
    values, bits, words = scratch.shaped(num_rows, numel)
    scales = torch.linalg.vector_norm(rows, dim=1, keepdim=True).div_(math.sqrt(numel))
    torch.ge(rows, 0, out=bits)
    _pack_bits(bits, words, packed[:, : numel // 8])
    scratch.expand(packed[:, : numel // 8], scales, values)
    torch.sub(rows, values, out=error)  # rows - scale * sign
    packed[:, numel // 8 :] = scales.to(torch.float32).view(torch.uint8).view(num_rows, _SCALE_BYTES)


def decompress_rows(packed: torch.Tensor, scratch: Scratch, out: torch.Tensor | None = None) -> torch.Tensor:
    """[r, m + 4] packed rows -> [r, 8 m] values scale * sign, in `out` (default: a view of `scratch.values`)."""
    num_rows, numel = packed.shape[0], (packed.shape[1] - _SCALE_BYTES) * 8
    if out is None:
        out = scratch.shaped(num_rows, numel)[0]
    scales = packed[:, -_SCALE_BYTES:].contiguous().view(torch.float32).to(out.dtype)  # [r, 1]
    return scratch.expand(packed[:, :-_SCALE_BYTES], scales, out)


class OneBitAllReduce:
    """The mean of one tensor's values over `group`, through 1-bit compression with error feedback; one object
    per tensor, holding that tensor's worker and server errors (see [Note: 1-bit compression])."""

    def __init__(
        self,
        numel: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        group: dist.ProcessGroup | None = None,
        scratch: Scratch | None = None,
    ) -> None:
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.numel = numel
        self.padded_numel = padded_numel(numel, self.world_size)
        self.chunk_numel = self.padded_numel // self.world_size
        row_bytes = self.chunk_numel // 8 + _SCALE_BYTES
        self.worker_error = torch.zeros(self.padded_numel, dtype=dtype, device=device)
        """This rank's compression error of its whole (padded) tensor, carried into the next call."""
        self.server_error = torch.zeros(self.chunk_numel, dtype=dtype, device=device)
        """The compression error of the chunk this rank serves, carried into the next call."""
        self._sent = torch.empty(self.world_size, row_bytes, dtype=torch.uint8, device=device)
        self._received = torch.empty_like(self._sent)
        self._served = torch.empty(1, row_bytes, dtype=torch.uint8, device=device)
        self._gathered = torch.empty_like(self._sent)
        self._served_values = torch.empty(1, self.chunk_numel, dtype=dtype, device=device)
        if scratch is None:
            scratch = Scratch.allocate(self.padded_numel, dtype, device)
        elif (
            scratch.values.dtype != dtype
            or scratch.values.device != device
            or scratch.values.numel() < self.padded_numel
        ):
            raise ValueError(
                f"OneBitAllReduce of {numel} elements ({dtype} on {device}, padded to {self.padded_numel}) was "
                f"given a Scratch of {scratch.values.numel()} {scratch.values.dtype} on {scratch.values.device}; "
                "allocate it with Scratch.allocate(padded_numel(largest numel, world size), dtype, device)"
            )
        self._scratch = scratch
        self._staging = scratch.staging[: self.padded_numel]

    def wire_bytes(self) -> int:
        """Bytes this rank hands to the collectives per call (the all-to-all's input, the all-gather's output)."""
        return 2 * self._sent.numel()

    def error_bytes(self) -> int:
        """Bytes of the two error buffers (state that checkpoints keep)."""
        return _nbytes(self.worker_error, self.server_error)

    def buffer_bytes(self) -> int:
        """Bytes of the packed rows and the served chunk's values (the shared Scratch is counted by its owner)."""
        return _nbytes(self._sent, self._received, self._served, self._gathered, self._served_values)

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
        torch.add(flat, self.worker_error[: self.numel], out=self._staging[: self.numel])
        self._staging[self.numel :].copy_(self.worker_error[self.numel :])  # the padding: zeros + the error
        compress_rows(rows, work_rows, self._sent, self._scratch)
        # Phase 2: row j of every rank to rank j
        collectives.all_to_all(self._received, self._sent, group=self.group)
        # Phase 3: average what this rank serves, add the server error, compress again
        served = torch.mean(
            decompress_rows(self._received, self._scratch), dim=0, keepdim=True, out=self._served_values
        )
        served.add_(self.server_error)
        compress_rows(served, self.server_error.view(1, -1), self._served, self._scratch)
        # Phase 4: every server's row to every rank
        collectives.all_gather(self._gathered.view(-1), self._served.view(-1), group=self.group)
        if self.numel == self.padded_numel:  # straight into the tensor, else through the padded scratch
            decompress_rows(self._gathered, self._scratch, out=flat.view(self.world_size, -1))
        else:
            flat.copy_(decompress_rows(self._gathered, self._scratch).view(-1)[: self.numel])

"""Compressed collectives: the 1-bit error-compensated all-reduce of the 1-bit optimizers (onebit.py)."""

from __future__ import annotations

from slipstream.comm.compressed.onebit import OneBitAllReduce, Scratch, pack_signs, padded_numel, unpack_signs

__all__ = ["OneBitAllReduce", "Scratch", "pack_signs", "padded_numel", "unpack_signs"]

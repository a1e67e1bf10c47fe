"""Compressed collectives: the 1-bit error-compensated all-reduce of the 1-bit optimizers (onebit.py)."""

from __future__ import annotations

from slipstream.comm.compressed.onebit import OneBitAllReduce, pack_signs, unpack_signs

__all__ = ["OneBitAllReduce", "pack_signs", "unpack_signs"]

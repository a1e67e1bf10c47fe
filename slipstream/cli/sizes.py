"""Byte sizes on the command lines of `slipstream bench comm`, `slipstream io` and `slipstream nvme tune`.

As in DeepSpeed's ds_bench / ds_io: K, M, G (and KiB, MiB, GiB) are powers of 2, so `--block-size 1M` is
1048576 bytes; KB, MB, GB are powers of 10; a plain number is bytes.
"""

from __future__ import annotations

import argparse
import re

_UNITS = {
    "": 1,
    "B": 1,
    "K": 1 << 10,
    "KIB": 1 << 10,
    "M": 1 << 20,
    "MIB": 1 << 20,
    "G": 1 << 30,
    "GIB": 1 << 30,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
}


def parse_bytes(text: str) -> int:
    """A positive byte count: "4096", "64K", "1M", "1MiB", "16MB"; an argparse error names the value."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; write bytes or a number with K, M, G (powers "
            "of 2, as DeepSpeed's tools) or KB, MB, GB (powers of 10), e.g. 1M"
        )
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be at least one byte")
    return value


def parse_bytes_list(text: str) -> list[int]:
    """Comma-separated sizes: "64K,1M,16M"."""
    items = [item for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"{text!r}: give one or more sizes separated by commas, e.g. 64K,1M")
    return [parse_bytes(item) for item in items]


def format_bytes(nbytes: int) -> str:
    """1048576 -> "1 MiB", 1536 -> "1.5 KiB", 100 -> "100 B"."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:g} {unit}" if unit == "B" else f"{value:.4g} {unit}"
        value /= 1024
    return f"{nbytes} B"


def positive_int(text: str) -> int:
    """An integer >= 1 (argparse type)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: expected an integer >= 1")
    return value

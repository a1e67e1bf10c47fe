"""The `slipstream` logger: rank-0 by default, quiet at import, `SLIPSTREAM_LOG=debug` for verbose output.

Nothing is printed at import. The first call to `get_logger()` attaches one stream handler (unless the
application configured logging itself); warnings are deduplicated per process with `warn_once`.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

_LOGGER_NAME = "slipstream"
_WARNED: set[str] = set()


def get_logger() -> logging.Logger:
    logger = logging.getLogger(_LOGGER_NAME)
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("[slipstream] %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
        level = os.environ.get("SLIPSTREAM_LOG", "info").upper()
        logger.setLevel(getattr(logging, level, logging.INFO))
    return logger


def log_rank0(message: str, *, rank: int) -> None:
    """Log at INFO on global rank 0 only."""
    if rank == 0:
        get_logger().info(message)


def first_time(key: str) -> bool:
    """True the first time `key` is asked about in this process (the once-set warn_once and the config notices
    share)."""
    if key in _WARNED:
        return False
    _WARNED.add(key)
    return True


def reset_once() -> None:
    """Forget which warn_once keys and notices were shown (the test suite does this before every test, so no
    test depends on what ran before it)."""
    _WARNED.clear()


def warn_once(key: str, message: str, category: type[Warning] = UserWarning) -> None:
    """A warning shown once per process for `key`."""
    if first_time(key):
        warnings.warn(message, category, stacklevel=3)

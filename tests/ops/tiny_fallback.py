"""Pure-Python stand-in for the tiny JIT test op (tests only)."""


def tiny_value() -> int:
    return -1

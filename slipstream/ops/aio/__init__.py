"""The `async_io` op's Python face: `AsyncIOBuilder` (DeepSpeed's `AsyncIOBuilder().load().aio_handle(...)`),
`AsyncIOError`, and `AsyncIOHandle`, a wrapper made from the `aio` section's settings over whichever module loaded.

Importing this package compiles nothing; the op is built or loaded on first `AsyncIOBuilder().load()`.
"""

from __future__ import annotations

from slipstream.ops.aio.errors import AsyncIOError
from slipstream.ops.aio.handle import AsyncIOHandle
from slipstream.ops.op_builder.async_io import AsyncIOBuilder

__all__ = ["AsyncIOBuilder", "AsyncIOError", "AsyncIOHandle"]

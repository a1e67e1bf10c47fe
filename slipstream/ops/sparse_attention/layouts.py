"""Block layouts of sparse self-attention, as DeepSpeed defines them: `make_layout(seq_len)` returns an int64
tensor [num_heads, seq_len // block, seq_len // block] whose 1s are the (query block, key block) pairs computed.

Fixed (Sparse Transformers' "fixed" pattern, DeepSpeed's variant): the blocks are cut into local windows of
num_local_blocks; each block attends to its window (to the blocks up to itself when unidirectional). In every
full window the num_global_blocks blocks ending (1 + h % num_different_global_patterns) * num_global_blocks
before the window's end are global: every row attends to them (rows from the global block on when
unidirectional), and with horizontal_global_attention they attend to every block. A short last window gets
its global blocks at the same offset, pulled back to fit. Unless different_layout_per_head, every head
copies head 0.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

import torch

__all__ = ["DenseSparsityConfig", "FixedSparsityConfig", "SparsityConfig", "VariableSparsityConfig"]


# [Note: layout configs are dataclasses] Each layout's DeepSpeed constructor arguments, in DeepSpeed's order
# (the base class's three first), are its fields; __post_init__ checks them and normalises the list arguments.
# eq=False keeps identity comparison and hashing, as a plain class has.


@dataclasses.dataclass(eq=False)
class SparsityConfig:
    """A layout family: heads, block size and whether heads differ."""

    num_heads: int
    block: int = 16
    different_layout_per_head: bool = False
    num_layout_heads: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.num_layout_heads = self.num_heads if self.different_layout_per_head else 1

    def setup_layout(self, seq_len: int) -> torch.Tensor:
        """An all-zero layout for `seq_len` tokens."""
        if seq_len % self.block:
            raise ValueError(
                f"sequence length {seq_len} is not a multiple of the block size {self.block}; pad the sequence "
                "(SparseAttentionUtils.pad_to_block_size in DeepSpeed) or pick another block"
            )
        blocks = seq_len // self.block
        return torch.zeros((self.num_heads, blocks, blocks), dtype=torch.int64)

    def check_and_propagate_first_head_layout(self, layout: torch.Tensor) -> torch.Tensor:
        """Every head takes head 0's layout unless heads differ."""
        if not self.different_layout_per_head:
            layout[1:] = layout[0]
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        """The layout: each of `layout_steps()` in turn for every head that has its own layout, then copies."""
        layout = self.setup_layout(seq_len)
        for h in range(self.num_layout_heads):
            for step in self.layout_steps():
                layout = step(h, layout)
        return self.check_and_propagate_first_head_layout(layout)

    def layout_steps(self) -> tuple[Callable[[int, torch.Tensor], torch.Tensor], ...]:
        """The per-head steps that set the layout's blocks, in order."""
        raise NotImplementedError(
            f"{type(self).__name__} defines no layout; use a subclass such as FixedSparsityConfig"
        )


class DenseSparsityConfig(SparsityConfig):
    """Every block (dense attention, for comparisons)."""

    def make_layout(self, seq_len: int) -> torch.Tensor:
        layout = self.setup_layout(seq_len)
        layout[:] = 1
        return layout


@dataclasses.dataclass(eq=False)
class FixedSparsityConfig(SparsityConfig):
    """Local windows plus global blocks (see the module doc)."""

    num_local_blocks: int = 4
    num_global_blocks: int = 1
    attention: str = "bidirectional"
    horizontal_global_attention: bool = False
    num_different_global_patterns: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        num_local_blocks, num_global_blocks = self.num_local_blocks, self.num_global_blocks
        num_different_global_patterns = self.num_different_global_patterns
        if num_local_blocks % num_global_blocks:
            raise ValueError(
                f"num_local_blocks ({num_local_blocks}) must be a multiple of num_global_blocks ({num_global_blocks})"
            )
        check_attention(self.attention, self.horizontal_global_attention)
        if num_different_global_patterns > 1 and not self.different_layout_per_head:
            raise ValueError(
                f"num_different_global_patterns={num_different_global_patterns} needs different_layout_per_head=True "
                "(one layout for all heads has one global pattern)"
            )
        if num_different_global_patterns > num_local_blocks // num_global_blocks:
            raise ValueError(
                f"num_different_global_patterns ({num_different_global_patterns}) exceeds num_local_blocks / "
                f"num_global_blocks = {num_local_blocks // num_global_blocks}; lower it"
            )

    def set_local_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        blocks, window = layout.shape[1], self.num_local_blocks
        for start in range(0, blocks, window):
            stop = min(start + window, blocks)
            for row in range(start, stop):
                layout[h, row, start : row + 1 if self.attention == "unidirectional" else stop] = 1
        return layout

    def set_global_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        blocks, window, width = layout.shape[1], self.num_local_blocks, self.num_global_blocks
        offset = window - (1 + h % self.num_different_global_patterns) * width
        full = blocks - blocks % window
        starts = list(range(offset, full, window))
        if full < blocks:  # a short last window: its global blocks at the same offset, pulled back to fit
            starts.append(min(full + offset, blocks - width))
        for start in starts:
            layout[h, 0 if self.attention == "bidirectional" else start :, start : start + width] = 1
            if self.horizontal_global_attention:
                layout[h, start : start + width, :] = 1
        return layout

    def layout_steps(self) -> tuple[Callable[[int, torch.Tensor], torch.Tensor], ...]:
        return (self.set_local_layout, self.set_global_layout)


@dataclasses.dataclass(eq=False)
class VariableSparsityConfig(SparsityConfig):
    """Fixed's generalisation: num_random_blocks random key blocks per row (Python's `random`, as DeepSpeed),
    local windows of the sizes in local_window_blocks (the last size repeats to the end), and global blocks
    at global_block_indices (or the ranges [global_block_indices[i], global_block_end_indices[i])) that every
    row attends to (rows from the block on when unidirectional) and, with horizontal_global_attention, that
    attend to every block."""

    num_random_blocks: int = 0
    local_window_blocks: list[int] | None = None
    global_block_indices: list[int] | None = None
    global_block_end_indices: list[int] | None = None
    attention: str = "bidirectional"
    horizontal_global_attention: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self.global_block_indices = check_global_ranges(self.global_block_indices, self.global_block_end_indices)
        check_attention(self.attention, self.horizontal_global_attention)
        self.local_window_blocks = [4] if self.local_window_blocks is None else list(self.local_window_blocks)

    def set_random_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        blocks = layout.shape[1]
        if blocks < self.num_random_blocks:
            raise ValueError(f"num_random_blocks ({self.num_random_blocks}) exceeds the {blocks} blocks of a row")
        for row in range(blocks):
            layout[h, row, random.sample(range(blocks), self.num_random_blocks)] = 1
        return layout

    def set_local_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        blocks, start = layout.shape[1], 0
        assert self.local_window_blocks is not None, "set by __post_init__"
        sizes = list(self.local_window_blocks)
        while start < blocks:
            size = sizes.pop(0) if len(sizes) > 1 else sizes[0]
            stop = min(start + size, blocks)
            for row in range(start, stop):
                layout[h, row, start : row + 1 if self.attention == "unidirectional" else stop] = 1
            start += size
        return layout

    def set_global_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        ranges = global_ranges(self.global_block_indices, self.global_block_end_indices, layout.shape[1])
        for start, end in ranges:
            if self.horizontal_global_attention:
                layout[h, start:end, :] = 1
            layout[h, 0 if self.attention == "bidirectional" else start :, start:end] = 1
        return layout

    def layout_steps(self) -> tuple[Callable[[int, torch.Tensor], torch.Tensor], ...]:
        return (self.set_random_layout, self.set_local_layout, self.set_global_layout)


def check_global_ranges(starts: list[int] | None, ends: list[int] | None) -> list[int]:
    """The global blocks' start indices ([0] by default), checked against their end indices when given."""
    starts = [0] if starts is None else list(starts)
    if ends is not None:
        if len(ends) != len(starts):
            raise ValueError(
                f"global_block_end_indices has {len(ends)} entries and global_block_indices {len(starts)}; give one "
                "end per start"
            )
        for start, end in zip(starts, ends):
            if start >= end:
                raise ValueError(f"global block range [{start}, {end}) is empty; each end must exceed its start")
    return starts


def global_ranges(starts: list[int] | None, ends: list[int] | None, blocks: int) -> list[tuple[int, int]]:
    """[start, end) of each global range that begins inside `blocks` blocks (single blocks without ends).
    `starts` is a config's checked start list (`check_global_ranges` made it a list in __post_init__)."""
    assert starts is not None, "global_block_indices is set by __post_init__"
    stops = ends if ends is not None else [start + 1 for start in starts]
    return [(start, min(end, blocks)) for start, end in zip(starts, stops) if start < blocks]


def check_attention(attention: str, horizontal_global_attention: bool) -> None:
    if attention not in ("unidirectional", "bidirectional"):
        raise NotImplementedError(f"attention={attention!r}: use 'unidirectional' or 'bidirectional'")
    if horizontal_global_attention and attention != "bidirectional":
        raise ValueError("horizontal_global_attention needs attention='bidirectional'")

"""Sliding-window block layouts, as DeepSpeed defines them.

- BigBird: num_random_blocks random key blocks per row (among the blocks up to the row when unidirectional;
  Python's `random`, as DeepSpeed), a sliding window of num_sliding_window_blocks centred on each row, and
  the first num_global_blocks blocks global both ways; unidirectional keeps the lower triangle.
- BSLongformer (block-sparse Longformer): the same sliding window, and global blocks at global_block_indices
  (or the ranges to global_block_end_indices) that attend to and are attended by every block; unidirectional
  keeps the lower triangle.
- LocalSlidingWindow: the sliding window alone; unidirectional (its default) keeps each row's window up to the
  row itself.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

import torch

from slipstream.ops.sparse_attention.layouts import (
    SparsityConfig,
    check_attention,
    check_global_ranges,
    global_ranges,
)

__all__ = ["BSLongformerSparsityConfig", "BigBirdSparsityConfig", "LocalSlidingWindowSparsityConfig"]


def _sliding_window(layout: torch.Tensor, h: int, width: int, causal: bool = False) -> None:
    """Row r attends to the blocks r - width // 2 .. r + width // 2 (.. r when causal), cut to the sequence."""
    blocks = layout.shape[1]
    if blocks < width:
        raise ValueError(f"num_sliding_window_blocks ({width}) exceeds the {blocks} blocks of the sequence")
    half = width // 2
    for row in range(blocks):
        layout[h, row, max(0, row - half) : row + 1 if causal else min(row + half + 1, blocks)] = 1


@dataclasses.dataclass(eq=False)  # See [Note: layout configs are dataclasses] in layouts.py
class BigBirdSparsityConfig(SparsityConfig):
    """Random, sliding-window and leading global blocks (see the module doc)."""

    num_random_blocks: int = 1
    num_sliding_window_blocks: int = 3
    num_global_blocks: int = 1
    attention: str = "bidirectional"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_attention(self.attention, False)

    def set_random_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        blocks = layout.shape[1]
        if blocks < self.num_random_blocks:
            raise ValueError(f"num_random_blocks ({self.num_random_blocks}) exceeds the {blocks} blocks of a row")
        if self.attention == "unidirectional" and self.num_random_blocks > 1:
            raise ValueError(
                f"num_random_blocks={self.num_random_blocks} with attention='unidirectional': the first row has one "
                "block to draw from (DeepSpeed fails there too); use at most 1"
            )
        for row in range(blocks):
            choices = range(blocks) if self.attention == "bidirectional" else range(row + 1)
            layout[h, row, random.sample(choices, self.num_random_blocks)] = 1
        return layout

    def set_sliding_window_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        _sliding_window(layout, h, self.num_sliding_window_blocks)
        return layout

    def set_global_layout_itc(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        blocks, width = layout.shape[1], self.num_global_blocks
        if blocks < width:
            raise ValueError(f"num_global_blocks ({width}) exceeds the {blocks} blocks of the sequence")
        layout[h, :width, :] = 1
        layout[h, :, :width] = 1
        return torch.tril(layout) if self.attention == "unidirectional" else layout

    def layout_steps(self) -> tuple[Callable[[int, torch.Tensor], torch.Tensor], ...]:
        return (self.set_random_layout, self.set_sliding_window_layout, self.set_global_layout_itc)


@dataclasses.dataclass(eq=False)
class BSLongformerSparsityConfig(SparsityConfig):
    """Sliding-window and global blocks (see the module doc)."""

    num_sliding_window_blocks: int = 3
    global_block_indices: list[int] | None = None
    global_block_end_indices: list[int] | None = None
    attention: str = "bidirectional"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_attention(self.attention, False)
        self.global_block_indices = check_global_ranges(self.global_block_indices, self.global_block_end_indices)

    def set_sliding_window_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        _sliding_window(layout, h, self.num_sliding_window_blocks)
        return layout

    def set_global_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        for start, end in global_ranges(self.global_block_indices, self.global_block_end_indices, layout.shape[1]):
            layout[h, start:end, :] = 1
            layout[h, :, start:end] = 1
        return torch.tril(layout) if self.attention == "unidirectional" else layout

    def layout_steps(self) -> tuple[Callable[[int, torch.Tensor], torch.Tensor], ...]:
        return (self.set_sliding_window_layout, self.set_global_layout)


@dataclasses.dataclass(eq=False)
class LocalSlidingWindowSparsityConfig(SparsityConfig):
    """A purely local sliding window (see the module doc). DeepSpeed's constructor takes no
    different_layout_per_head: every head has the same layout."""

    num_sliding_window_blocks: int = 3
    attention: str = "unidirectional"
    different_layout_per_head: bool = dataclasses.field(default=False, init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_attention(self.attention, False)

    def set_sliding_window_layout(self, h: int, layout: torch.Tensor) -> torch.Tensor:
        _sliding_window(layout, h, self.num_sliding_window_blocks, causal=self.attention == "unidirectional")
        return layout

    def layout_steps(self) -> tuple[Callable[[int, torch.Tensor], torch.Tensor], ...]:
        return (self.set_sliding_window_layout,)

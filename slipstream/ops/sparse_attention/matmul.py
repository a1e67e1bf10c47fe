"""DeepSpeed's block-sparse matrix product (`deepspeed.ops.sparse_attention.matmul.MatMul`) in pure PyTorch.

A block-sparse matrix is stored as its layout's non-zero blocks, [batch, nnz, block, block], in the order of
`layout.nonzero()` (head, block row, block column); the layout is [heads, block rows, block columns]. Modes name
the operands' kinds (output, first, second; s sparse, d dense): `sdd` computes only the layout's blocks of a
dense product, `dsd` and `dds` multiply a sparse operand by a dense one. Each product is taken block by block
(the blocks' rows or columns gathered, products of half precision accumulated in float32), so the work and the
memory grow with the non-zero blocks, not with the full matrix; autograd runs through the gathers.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["LayoutIndex", "MatMul", "compute_dtype"]

MODES = ("sdd", "dsd", "dds")


@dataclasses.dataclass(frozen=True)
class LayoutIndex:
    """A layout's non-zero blocks: their head, block row and block column, in storage order."""

    heads: int
    rows: int
    columns: int
    head: torch.Tensor
    row: torch.Tensor
    column: torch.Tensor

    @classmethod
    def of(cls, layout: torch.Tensor) -> LayoutIndex:
        if layout.dim() != 3:
            raise ValueError(
                f"layout has shape {tuple(layout.shape)}; a block layout is [heads, block rows, block columns]"
            )
        head, row, column = layout.to(torch.bool).nonzero(as_tuple=True)
        heads, rows, columns = layout.shape
        return cls(heads, rows, columns, head, row, column)

    def on(self, device: torch.device) -> LayoutIndex:
        if self.head.device == device:
            return self
        moved = (t.to(device) for t in (self.head, self.row, self.column))
        return LayoutIndex(self.heads, self.rows, self.columns, *moved)

    def transposed(self) -> LayoutIndex:
        """The index of the transposed matrix's blocks (same storage order)."""
        return LayoutIndex(self.heads, self.columns, self.rows, self.head, self.column, self.row)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half-precision blocks are computed in float32 and returned in their own dtype."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _row_blocks(dense: torch.Tensor, index: LayoutIndex, block: int, rows: torch.Tensor) -> torch.Tensor:
    """[batch, heads, R, C] -> each block's block-row strip [batch, nnz, block, C] (row `rows` of head)."""
    batch, heads, height, width = dense.shape
    return dense.reshape(batch, heads, height // block, block, width)[:, index.head, rows]


def _column_blocks(dense: torch.Tensor, index: LayoutIndex, block: int, columns: torch.Tensor) -> torch.Tensor:
    """[batch, heads, R, C] -> each block's block-column strip [batch, nnz, R, block]."""
    batch, heads, height, width = dense.shape
    strips = dense.reshape(batch, heads, height, width // block, block).permute(0, 1, 3, 2, 4)
    return strips[:, index.head, columns]


def _check(mode: str, name: str, tensor: torch.Tensor, sparse: bool) -> None:
    if tensor.dim() != 4:
        kind = "its non-zero blocks [batch, nnz, block, block]" if sparse else "[batch, heads, rows, columns]"
        raise ValueError(f"MatMul({mode!r}): {name} has shape {tuple(tensor.shape)}; it must be {kind}")


class MatMul:
    """`MatMul(layout, block, mode, trans_a=False, trans_b=False)(a, b)`: op(a) @ op(b) where op transposes
    the operands named by trans_a / trans_b. The layout describes the sparse operand as stored (before its
    transpose) or, for `sdd`, the output."""

    def __init__(
        self,
        layout: torch.Tensor,
        block: int,
        mode: str,
        trans_a: bool = False,
        trans_b: bool = False,
        bench: bool = False,
    ) -> None:
        if mode not in MODES:
            raise NotImplementedError(f"MatMul mode {mode!r} is not one of {MODES}")
        self.layout, self.block, self.mode = layout, block, mode
        self.trans_a, self.trans_b = trans_a, trans_b
        self.index = LayoutIndex.of(layout)

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        _check(self.mode, "a", a, self.mode == "dsd")
        _check(self.mode, "b", b, self.mode == "dds")
        index = self.index.on(a.device)
        dtype = a.dtype
        a, b = a.to(compute_dtype(dtype)), b.to(compute_dtype(dtype))
        if self.mode == "sdd":
            out = self._sdd(self._dense(a, self.trans_a), self._dense(b, self.trans_b), index)
        elif self.mode == "dsd":
            out = self._dsd(a, self._dense(b, self.trans_b), index)
        else:
            out = self._dds(self._dense(a, self.trans_a), b, index)
        return out.to(dtype)

    @staticmethod
    def _dense(x: torch.Tensor, transpose: bool) -> torch.Tensor:
        return x.transpose(-2, -1) if transpose else x

    def _sdd(self, a: torch.Tensor, b: torch.Tensor, index: LayoutIndex) -> torch.Tensor:
        return _row_blocks(a, index, self.block, index.row) @ _column_blocks(b, index, self.block, index.column)

    def _dsd(self, blocks: torch.Tensor, b: torch.Tensor, index: LayoutIndex) -> torch.Tensor:
        if self.trans_a:
            blocks, index = blocks.transpose(-2, -1), index.transposed()
        products = blocks @ _row_blocks(b, index, self.block, index.column)  # [batch, nnz, block, N]
        batch, _, _, width = products.shape
        out = products.new_zeros(batch, index.heads * index.rows, self.block, width)
        out = out.index_add(1, index.head * index.rows + index.row, products)
        return out.reshape(batch, index.heads, index.rows * self.block, width)

    def _dds(self, a: torch.Tensor, blocks: torch.Tensor, index: LayoutIndex) -> torch.Tensor:
        if self.trans_b:
            blocks, index = blocks.transpose(-2, -1), index.transposed()
        products = _column_blocks(a, index, self.block, index.row) @ blocks  # [batch, nnz, M, block]
        batch, _, height, _ = products.shape
        out = products.new_zeros(batch, index.heads * index.columns, height, self.block)
        out = out.index_add(1, index.head * index.columns + index.column, products)
        out = out.reshape(batch, index.heads, index.columns, height, self.block).permute(0, 1, 3, 2, 4)
        return out.reshape(batch, index.heads, height, index.columns * self.block)

"""A row copy of a 16-bit matrix between row strides TMA cannot share: ``out[r, c] = x[r, c]``
for c < x's columns and ``out[r, c] = 0`` for the rest of out's columns.

Two uses: staging an operand whose rows do not start on 16-byte boundaries (an odd K, e.g.
the softmax rows of p @ v at an odd sequence length) into a K-major buffer with K padded to
a multiple of 8 (exact zero products: the bits do not change), and the reverse, copying a
result stored into padded rows back into rows of its true width.

Work: one CTA of 256 threads per (row, 2048 columns); thread t moves columns t, t + 256,
..., so every load and store instruction of a warp covers 64 consecutive bytes of one row
whatever the row's alignment. No division per element: the row is the block's x index.
PyTorch's strided copy of the same views computes a 64-bit offset per element and runs at
about half the copy bandwidth.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

THREADS = 256
PER_THREAD = 8
COLS_PER_CTA = THREADS * PER_THREAD


class CopyRows:
    """out[r, c] = x[r, c] if c < x.cols else 0, for r < rows, c < out.cols."""

    @cute.jit
    def __call__(self, mX: cute.Tensor, mO: cute.Tensor, stream):
        grid = [cute.size(mO, mode=[0]),
                (cute.size(mO, mode=[1]) + COLS_PER_CTA - 1) // COLS_PER_CTA, 1]
        self.kernel(mX, mO).launch(grid=grid, block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mO: cute.Tensor):
        tx, _, _ = cute.arch.thread_idx()
        r, by, _ = cute.arch.block_idx()
        x_cols, o_cols = cute.size(mX, mode=[1]), cute.size(mO, mode=[1])
        for j in cutlass.range_constexpr(PER_THREAD):
            c = by * COLS_PER_CTA + j * THREADS + tx
            if c < o_cols:
                v = mO.element_type(0)
                if c < x_cols:
                    v = mX[r, c]
                mO[r, c] = v
